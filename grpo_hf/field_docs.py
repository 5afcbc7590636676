"""The parameter entries of a settings dataclass's docstring, generated from its fields' help (written once)."""

import dataclasses
import json
import textwrap
import typing


def append_field_docs(cls: type, names: list[str], headings: dict[str, str]) -> None:
    """
    Append to the docstring of the dataclass `cls` one entry per field of `names`, in the Hugging Face format, so that
    `help()`, IDEs and the doc-builder show the same text as `--help-all` and the settings table of `docs/settings.md`:

        name (`type`, *optional*, defaults to `value`):
            the field's `metadata["help"]` (`%%` as `%`), wrapped

    (without `, defaults to ...` for a field that defaults to `None`). `headings` maps the first field of each section
    to the section's heading (e.g. `"Parameters that control grouping:"`, or `"Args:"`); the fields that follow it in
    `names` belong to that section. Nothing is appended when Python runs without docstrings (`-OO`).
    """
    if cls.__doc__ is None:
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    wrap = {"width": 119, "break_long_words": False, "break_on_hyphens": False}
    lines = []
    for name in names:
        if name in headings:
            lines += ["", *textwrap.wrap(headings[name], initial_indent="    ", subsequent_indent="    ", **wrap), ""]
        kinds = [kind for kind in typing.get_args(hints[name]) or [hints[name]] if kind is not type(None)]
        entry = " or ".join(f"`{kind.__name__}`" for kind in kinds) + ", *optional*"
        default = fields[name].default
        if default is not None:
            entry += f", defaults to `{json.dumps(default) if isinstance(default, str) else default}`"
        lines.append(f"        {name} ({entry}):")
        text = fields[name].metadata["help"].replace("%%", "%")
        lines += textwrap.wrap(text, initial_indent=" " * 12, subsequent_indent=" " * 12, **wrap)
    cls.__doc__ = cls.__doc__.rstrip() + "\n" + "\n".join(lines) + "\n    "
