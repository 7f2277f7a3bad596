"""A self-contained HTML page of an evaluation: the metrics, the samples that were skipped (with their reasons),
then examples with image, prompt, prediction, references and score. Images are inlined as base64 PNG thumbnails,
so the page opens anywhere without its folder.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from vlmctl.evaluation.results import SKIPPED_FILE, EvalResult, atomic_write, skipped_reasons

# PIL is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Light vlmctl modules are imported next to their use as well.

MAX_EXAMPLES = 48
MAX_SKIPPED_ROWS = 200
THUMBNAIL_PX = 192

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin-bottom:1.5em}
td,th{border:1px solid #ddd;padding:6px 10px;vertical-align:top;text-align:left}
th{background:#f4f4f4}
pre{white-space:pre-wrap;margin:0;max-width:40em;font-size:12px;color:#555}
.ok{background:#e8f6e8}.partial{background:#fdf6e0}.bad{background:#fbe9e9}
img{image-rendering:pixelated;border:1px solid #ccc}
"""


def thumbnail_data_uri(image: bytes, max_px: int = THUMBNAIL_PX) -> str | None:
    """`data:image/png;base64,...` of the image scaled to fit `max_px` (small images are scaled up, pixelated);
    None when the bytes do not decode."""
    from PIL import Image

    from vlmctl.data.images import open_image

    try:
        img = open_image(image).convert("RGB")
    except Exception:  # noqa: BLE001 - a broken image must not break the report
        return None
    scale = max_px / max(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def render_report(result: EvalResult, images: dict[str, bytes], max_examples: int = MAX_EXAMPLES) -> str:
    """The HTML text of the page for `result`; `images` maps sample id -> first image bytes."""
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>vlmctl eval: {esc(result.task)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>Evaluation: {esc(result.task)}</h1>",
        f"<p>Model <code>{esc(result.model)}</code> on <code>{esc(result.data)}</code>, {len(result.records)} samples.</p>",
        "<table><tr><th>metric</th><th>value</th></tr>",
        *(f"<tr><td>{esc(k)}</td><td>{v:.4f}</td></tr>" for k, v in result.metrics.items()),
        "</table>",
        *_skipped_section(result),
    ]
    shown = result.records[:max_examples]
    if shown:
        parts.append(f"<h2>First {len(shown)} examples</h2><table>")
        if result.task == "loss":
            parts.append("<tr><th>id</th><th>image</th><th>loss (nats/token)</th></tr>")
        else:
            parts.append("<tr><th>id</th><th>image</th><th>prompt</th><th>prediction</th><th>references</th><th>score</th></tr>")
        for r in shown:
            uri = thumbnail_data_uri(images[r.id]) if r.id in images else None
            img = f"<img src='{uri}' alt='{esc(r.id)}'>" if uri else ""
            score = "" if r.score is None else f"{r.score:.3f}"
            if result.task == "loss":
                parts.append(f"<tr><td>{esc(r.id)}</td><td>{img}</td><td>{score}</td></tr>")
                continue
            css = "" if r.score is None else "ok" if r.score >= 0.999 else "bad" if r.score <= 0 else "partial"
            refs = "<br>".join(esc(x) for x in r.references[:10])
            opts = ""
            if r.options:
                items = r.options.items() if isinstance(r.options, dict) else zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", r.options)
                opts = "<br>" + "<br>".join(f"{esc(k)}. {esc(str(v))}" for k, v in items)
            parts.append(
                f"<tr class='{css}'><td>{esc(r.id)}</td><td>{img}</td><td><pre>{esc(r.prompt)}</pre>{opts}</td>"
                f"<td><b>{esc(r.prediction)}</b></td><td>{refs}</td><td>{score}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _skipped_section(result: EvalResult) -> list[str]:
    """The skipped samples: counts per reason, then one row per sample (the first MAX_SKIPPED_ROWS)."""
    if not result.skipped:
        return []
    esc = html.escape
    n = len(result.skipped)
    reasons = ", ".join(f"{esc(r)}: {c}" for r, c in skipped_reasons(result.skipped).items())
    out = [
        f"<h2 id='skipped'>Skipped samples ({n})</h2>",
        f"<p>{n} of {n + len(result.records)} samples could not be evaluated and are not in the metrics ({reasons}); "
        f"all are listed in <code>{SKIPPED_FILE}</code>.</p>",
        "<table><tr><th>location</th><th>id</th><th>reason</th><th>detail</th></tr>",
    ]
    for s in result.skipped[:MAX_SKIPPED_ROWS]:
        out.append(f"<tr class='bad'><td>{esc(str(s.get('location') or ''))}</td><td>{esc(str(s.get('id') or ''))}</td>"
                   f"<td>{esc(str(s['reason']))}</td><td>{esc(str(s.get('detail') or ''))}</td></tr>")
    if n > MAX_SKIPPED_ROWS:
        out.append(f"<tr><td colspan='4'>... and {n - MAX_SKIPPED_ROWS} more</td></tr>")
    out.append("</table>")
    return out


def write_report(path: Path, result: EvalResult, images: dict[str, bytes], max_examples: int = MAX_EXAMPLES) -> Path:
    """Write `render_report(...)` to `path` through a temporary file; returns `path`."""
    return atomic_write(Path(path), render_report(result, images, max_examples))
