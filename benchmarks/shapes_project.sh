# Sourced by the GPU benchmark scripts: `shapes_project NAME PRESET SAMPLES VAL_RATIO` builds, in the current folder,
# once (skipped when outputs/model/config.json exists), a project of SAMPLES generated shapes-VQA samples (64 px
# pictures, VAL_RATIO of them held out by the data split, project seed 0) and the PRESET built with random weights
# in bf16, with `vlmctl` on the PYTHONPATH the caller exported. Returns 1 when the build fails.
shapes_project() {
    local name=$1 preset=$2 samples=$3 val=$4 t0=$SECONDS
    [ -f outputs/model/config.json ] && return 0
    python3 -c "from vlmctl.data.synthetic import generate_shapes_vqa; generate_shapes_vqa('data/raw', num_samples=$samples, image_size=64)" >/dev/null
    cat > vlmctl.yaml <<YAML
project: {name: $name, seed: 0}
data: {sources: [{path: data/raw/shapes_vqa.json, format: llava}], prepared_dir: data/prepared, val_ratio: $val}
model: {preset: $preset, init: random, dtype: bf16, output_dir: outputs/model}
YAML
    python3 -m vlmctl --quiet data prepare --num-proc 8 >/dev/null && python3 -m vlmctl --quiet model build --force >/dev/null \
        || { echo "the project could not be built" >&2; return 1; }
    echo "== built $preset in $(( SECONDS - t0 )) s"
}
