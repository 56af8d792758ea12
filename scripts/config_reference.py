"""Write docs/reference/config.md from the configuration's own schema: every key of the YAML
file, its type, its default and its description, read from the pydantic models and their field
descriptions, so the reference cannot drift from what `corral serve` accepts.

Usage: python scripts/config_reference.py [--check]   (--check: exit 1 if the file is stale)"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "config.md"
sys.path.insert(0, str(ROOT / "src"))

HEAD = """# Configuration reference

Every key of Corral's configuration file (`corral serve --config FILE`, `corral simulate
--config FILE`), written from the schema itself by `scripts/config_reference.py`: a test fails
when this page and the code disagree. Unknown keys are errors, so a typo never passes silently;
`corral config check FILE` reports every problem at once with its line. llama-swap's own
configuration is accepted as it is (docs/llama-swap.md).

A minimal file:

```yaml
models:
  chat:
    cmd: llama-server --port ${PORT} -m /models/chat.gguf
  embed:
    upstream: http://127.0.0.1:9000
```
"""


def type_name(annotation: Any) -> str:
    """A YAML reader's name for `annotation`."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        tail = " or null" if type(None) in args else ""
        return " or ".join(dict.fromkeys(names)) + tail
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of name to {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in simple:
        return simple[annotation]
    return "any" if annotation is Any else getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        return "(its section's defaults)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value in ([], {}):
        return "empty"
    if isinstance(value, list) and all(isinstance(v, BaseModel) for v in value):
        return "see the description"
    return f"`{value}`"


def one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def models_under(root: type[BaseModel]) -> list[type[BaseModel]]:
    """`root` and every model its fields hold, in the order a reader meets them."""
    seen: list[type[BaseModel]] = []

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.append(model)
        for field in model.model_fields.values():
            for inner in _models_in(field.annotation):
                visit(inner)

    visit(root)
    return seen


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def render() -> str:
    from corral.config import Config

    parts = [HEAD]
    for model in models_under(Config):
        doc = one_line(model.__doc__)
        parts.append(
            "\n## The file\n"
            if model is Config
            else f'\n<a id="{model.__name__.lower()}"></a>\n## {model.__name__}\n'
        )
        parts.append(f"\n{doc}\n\n| key | type | default | what it does |\n|---|---|---|---|\n")
        for name, field in model.model_fields.items():
            key = field.alias or name
            parts.append(
                f"| `{key}` | {type_name(field.annotation)} | {default_text(field)} "
                f"| {one_line(field.description)} |\n"
            )
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not current")
    args = ap.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            sys.exit(f"{OUT.relative_to(ROOT)} is stale: run python scripts/config_reference.py")
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
