"""The chat template compiler: a jinja2 Template in the environment transformers renders chat templates in.

Its own module because two readers of saved model folders need it without needing each other: token counting
(`vlmctl.data.tokens`) renders templates, and the model-file checks (`vlmctl.data.model_files`) compile one to name a
broken `chat_template.jinja`.
"""

from __future__ import annotations

import json

# jinja2 is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.


def compile_chat_template(template: str):
    """A jinja2 Template of `template` in the environment transformers renders chat templates in (see
    `_template_renderer`). Raises jinja2.TemplateSyntaxError for a broken template."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # `{% generation %}...{% endgeneration %}` marks the assistant's tokens for training; rendering keeps the body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # As transformers': no underscore attributes on namespaces (a sandbox escape route).
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: no HTML escaping, and json.dumps's options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **k: dict(*a, **k), namespace=Namespace)
    return env.from_string(template)
