"""MkDocs hook: the pages and tables that are generated, so they cannot drift.

Run by `mkdocs build` / `mkdocs serve` (mkdocs.yml: `hooks:`). Nothing is
written into docs/: generated pages and copied images are added to the build
as in-memory files (`File.generated`), and generated tables replace
directives in the hand-written pages while they are rendered.

- `configuration/reference.md`: the configuration reference, walked from the
  config's root dataclass (`gateway.config.sections.Config`) and every
  policy's own table (`gateway.policies.registry.tables()`): each option's
  type, default and bounds from the dataclass fields, its description from
  the comment lines above the key in the packaged `default.toml` (else the
  comment beside the field in the source).
- `assets/results/*.png` (and the qos-rl learning curve): copied from
  `loadtest/results/` and `models/qos_rl/`.
- Directives in pages, each an HTML comment holding YAML:
  `<!-- gen:table ... -->` rows of a results CSV, `<!-- gen:pivot ... -->` one
  figure by row and column keys, `<!-- gen:claims ... -->` the labelled claims
  of docs/claims.toml with the measured figure read from its results file,
  `<!-- gen:policies -->` the policy registry's table, `<!-- gen:json ... -->`
  rows of a JSON results file.

A directive that names a missing file, row or column fails the build, so a
rerun sweep that changes shape is noticed instead of published wrong.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import inspect
import json
import logging
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.generate")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtest" / "results"
CLAIMS = ROOT / "docs" / "claims.toml"
LABELS = ("calibrated", "reproduced", "does not hold", "not comparable")
IMAGES = {**{p.name: p for p in sorted(RESULTS.glob("*.png"))},
          **{f"untuned_{p.name}": p for p in sorted(RESULTS.glob("untuned/*.png"))},
          "qos_rl_learning_curve.png": ROOT / "models" / "qos_rl" / "learning_curve.png"}


# --------------------------------------------------------------------------
# MkDocs events


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "configuration/reference.md", content=config_reference()))
    for name, path in IMAGES.items():
        if path.exists():
            files.append(File.generated(config, f"assets/results/{name}", abs_src_path=str(path)))
    return files


DIRECTIVE = re.compile(r"<!--\s*gen:(\w+)(.*?)-->", re.S)


def on_page_markdown(markdown: str, page, config, files) -> str:
    def expand(match: re.Match) -> str:
        kind, body = match.group(1), match.group(2)
        spec = yaml.safe_load(body) if body.strip() else {}
        try:
            return RENDERERS[kind](spec or {})
        except KeyError as err:
            raise PluginError(f"{page.file.src_uri}: gen:{kind}: {err}") from err
        except (ValueError, FileNotFoundError) as err:
            raise PluginError(f"{page.file.src_uri}: gen:{kind}: {err}") from err

    return DIRECTIVE.sub(expand, markdown)


# --------------------------------------------------------------------------
# Results files


@functools.cache
def _rows(name: str) -> tuple[dict[str, str], ...]:
    with open(RESULTS / name, newline="") as fh:
        return tuple(csv.DictReader(fh))


def _same(value: str, want: Any) -> bool:
    if isinstance(want, list):
        return any(_same(value, w) for w in want)
    if isinstance(want, str) and want.startswith("~"):
        return want[1:] in value
    if isinstance(want, str) and want.startswith("!"):
        return not _same(value, want[1:])
    try:
        return math.isclose(float(value), float(want))
    except (TypeError, ValueError):
        return value == ("" if want is None else str(want))


def select(name: str, where: Mapping[str, Any] | None = None, exclude: Mapping[str, Any] | None = None):
    rows = _rows(name)
    for key in list(where or {}) + list(exclude or {}):
        if rows and key not in rows[0]:
            raise ValueError(f"{name} has no column {key!r}")
    return [r for r in rows
            if all(_same(r[k], v) for k, v in (where or {}).items())
            and not any(_same(r[k], v) for k, v in (exclude or {}).items())]


def one(name: str, where: Mapping[str, Any]) -> dict[str, str]:
    found = select(name, where)
    if len(found) != 1:
        raise ValueError(f"{name}: {len(found)} rows match {dict(where)}, expected one")
    return found[0]


def _num(row: Mapping[str, str], column: str) -> float:
    if column not in row:
        raise ValueError(f"no column {column!r}")
    return float(row[column])


def fmt(row: Mapping[str, str], column: str, style: str = "") -> str:
    """One figure of a row. Styles: ciN (value [lo, hi], N decimals), N (decimals),
    eN (scientific), pctN (a share x 100), relN (a relative change, signed %, with its interval),
    diffN (a signed difference with its interval), kciN and kdiffN (ciN and diffN x 1000: a cost per
    request shown per 1k requests), mix (the tier mix), text."""
    if style == "text":
        return row[column]
    if style == "mix":
        tiers = [k for k in row if k.startswith("mix_")]
        return " / ".join(f"{100 * float(row[k]):.0f}" for k in tiers)
    if column in row and row[column].strip() in ("", "nan"):
        return ""
    value = _num(row, column)
    if math.isnan(value):
        return ""
    kind, digits = re.fullmatch(r"([a-z]*)(\d*)", style or "").groups()  # type: ignore[union-attr]
    n = int(digits) if digits else 2

    def interval(scale: float = 1.0, sign: str = "") -> str:
        if f"{column}_lo" in row and row[f"{column}_lo"] not in ("", "nan"):
            lo, hi = _num(row, f"{column}_lo") * scale, _num(row, f"{column}_hi") * scale
            return f" [{lo:{sign}.{n}f}, {hi:{sign}.{n}f}]"
        return ""

    if kind == "ci":
        return f"{value:.{n}f}{interval()}"
    if kind == "ms":
        return f"{1000 * value:.{n}f}"
    if kind == "msci":
        return f"{1000 * value:.{n}f}{interval(1000)}"
    if kind == "e":
        return f"{value:.{n}e}"
    if kind == "pct":
        return f"{100 * value:.{n}f}%"
    if kind == "pctci":
        return f"{100 * value:.{n}f}{interval(100)}%"
    if kind == "rel":
        return f"{100 * value:+.{n}f}%{interval(100, '+')}"
    if kind == "diff":
        return f"{value:+.{n}f}{interval(1, '+')}"
    if kind == "kci":
        return f"{1000 * value:.{n}f}{interval(1000)}"
    if kind == "kdiff":
        return f"{1000 * value:+.{n}f}{interval(1000, '+')}"
    return f"{value:,.{n}f}"


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def _columns(spec) -> list[tuple[str, str, str]]:
    out = []
    for col in spec["columns"]:
        header, column, *style = col
        out.append((header, column, style[0] if style else "text"))
    return out


def render_table(spec) -> str:
    """Rows of one results CSV: file, where, exclude, columns: [[header, column, style], ...]."""
    rows = select(spec["file"], spec.get("where"), spec.get("exclude"))
    if not rows:
        raise ValueError(f"{spec['file']}: no rows match {spec.get('where')}")
    cols = _columns(spec)
    return _table([c[0] for c in cols], [[fmt(r, c, s) for _, c, s in cols] for r in rows])


def render_pivot(spec) -> str:
    """One figure of a results CSV, by row keys (rows) and one column key (cols)."""
    rows = select(spec["file"], spec.get("where"), spec.get("exclude"))
    keys, col_keys = spec["rows"], spec["cols"]
    col_keys = col_keys if isinstance(col_keys, list) else [col_keys]
    column, style = spec["value"]
    col_values: list[str] = []
    table: dict[tuple, dict[str, str]] = {}
    for r in rows:
        col = " @".join(_clean(r[k]) for k in col_keys)
        if col not in col_values:
            col_values.append(col)
        table.setdefault(tuple(_clean(r[k]) if k != "label" else r[k] for k in keys), {})[col] = fmt(r, column, style)
    if not table:
        raise ValueError(f"{spec['file']}: no rows match {spec.get('where')}")
    header = spec.get("headers", keys) + [f"{v}{spec.get('col_suffix', '')}" for v in col_values]
    body = [list(k) + [cells.get(v, "") for v in col_values] for k, cells in table.items()]
    return _table(header, body)


def _clean(value: str) -> str:
    try:
        return f"{float(value):g}"
    except ValueError:
        return value


def render_json(spec) -> str:
    """Rows of a JSON results file: file, path (keys to the list of rows), columns [[header, key, style]]."""
    data: Any = json.loads((RESULTS / spec["file"]).read_text())
    for key in spec.get("path", []):
        data = data[key]
    cols = _columns(spec)
    body = []
    for item in data:
        row = {k: (" / ".join(f"{x:,}" for x in v) if isinstance(v, list) else str(v)) for k, v in item.items()}
        body.append([fmt(row, c, s) for _, c, s in cols])
    return _table([c[0] for c in cols], body)


# --------------------------------------------------------------------------
# Claims: docs/claims.toml, each with its label and where its measured figure is


@functools.cache
def claims() -> tuple[dict, ...]:
    data = tomllib.loads(CLAIMS.read_text())
    out = tuple(data["claim"])
    for c in out:
        if c["label"] not in LABELS:
            raise PluginError(f"claims.toml: {c['id']}: label {c['label']!r} is not one of {LABELS}")
    return out


def measured(claim: dict) -> str:
    parts = []
    for m in claim.get("measured", []):
        row = one(m["file"], m["where"])
        parts.append(f"{m.get('what', '')} {fmt(row, m['column'], m.get('style', ''))}".strip())
    return "; ".join(parts)


BADGE = {"calibrated": "calibrated", "reproduced": "reproduced",
         "does not hold": "does-not-hold", "not comparable": "not-comparable"}


def render_claims(spec) -> str:
    chosen = [c for c in claims()
              if all(c.get(k) == v or (isinstance(c.get(k), list) and v in c[k]) for k, v in spec.items())]
    if not chosen:
        raise ValueError(f"no claim matches {spec}")
    out = []
    for c in chosen:
        label = f'<span class="claim claim-{BADGE[c["label"]]}">{c["label"]}</span>'
        lines = [f"- {label} **{c['claim']}**"]
        if c.get("paper"):
            lines.append(f"    - Paper: {c['paper']}")
        got = measured(c)
        if got:
            lines.append(f"    - Measured: {got}" + (f" ({c['source']})" if c.get("source") else ""))
        if c.get("reason"):
            lines.append(f"    - Why this label: {c['reason']}")
        out.append("\n".join(lines))
    return "\n".join(out) + "\n"


def render_label_counts(spec) -> str:
    counts = {label: sum(c["label"] == label for c in claims()) for label in LABELS}
    return _table(["label", "claims"], [[k, str(v)] for k, v in counts.items()])


def render_policies(spec) -> str:
    from gateway.policies import registry

    return registry.table() + "\n"


# --------------------------------------------------------------------------
# The configuration reference


def _config_root() -> type:
    from gateway.config import sections

    root = getattr(sections, "Config", None)
    if root is None:  # renamed: the dataclass that holds the instances
        root = next(obj for obj in vars(sections).values()
                    if dataclasses.is_dataclass(obj) and "instances" in {f.name for f in dataclasses.fields(obj)})
    return root


@functools.cache
def toml_comments() -> dict[str, str]:
    """Key path -> the comment lines right above it in the packaged default.toml.

    A comment block describes the run of keys that follows it (`max_header_bytes`
    and `max_headers` share one). Commented-out keys (`# metrics_port = 9100`)
    count as keys. Keys of array tables are filed under `[]` (`instances[].url`).
    """
    from gateway.config import sections

    path = Path(inspect.getfile(sections)).with_name("default.toml")
    found: dict[str, str] = {}
    table, block, last = "", [], ""
    key_line = re.compile(r"#?\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*\S")
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line:
            block, last = [], ""
            continue
        header = re.fullmatch(r"(\[\[?)([^\]]+)\]\]?", line)
        if header:
            table = header.group(2).strip() + ("[]" if header.group(1) == "[[" else "")
            table = re.sub(r"^instances\[\]\.", "instances[].", table.replace("instances.", "instances[]."))
            block, last = [], ""
            continue
        key = key_line.fullmatch(line) or key_line.match(line)
        commented_key = line.startswith("#") and key and len(line) < 90 and "  " not in line.lstrip("# ")
        if not line.startswith("#") or commented_key:
            name = key.group(1) if key else ""
            if name:
                full = f"{table}.{name}" if table else name
                if block and full not in found:
                    found[full] = " ".join(block)
                elif last and full not in found:
                    found[full] = "\x00" + last  # shares the block above another key
                last = last if not block else name
            block = []
            continue
        block.append(line.lstrip("#").strip())
    for full, text in _legends(path.read_text()).items():
        found.setdefault(full, text)
    return found


def _legends(text: str) -> dict[str, str]:
    """Keys documented in a legend inside a comment (`#   name   REQUIRED  unique label`), e.g. the
    pool's `[[instances]]` keys and the example `[instances.moe]` and `[[auth.keys]]` tables."""
    found: dict[str, str] = {}
    context, last = "", ""
    entry = re.compile(r"#\s{2,}([a-z_][a-z0-9_]*)\s*(?:=\s*(?:\"[^\"]*\"|\[[^\]]*\]|\S+))?\s{2,}"
                       r"(?:REQUIRED\s+|\[[^\]]*\]\s+)?(.+)")
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("#"):
            context, last = ("", "") if line.startswith("[") else (context, last)
            continue
        table = re.fullmatch(r"#\s+(\[\[?)([^\]]+)\]\]?", line)
        if table:
            name = table.group(2).strip().replace("instances.", "instances[].")
            context, last = name + ("[]" if table.group(1) == "[[" else ""), ""
            continue
        if "one [[instances]] table" in line:
            context, last = "instances[]", ""
            continue
        body = line[1:]
        if last and len(body) - len(body.lstrip()) >= 10:
            found[last] += " " + body.strip()
            continue
        m = entry.fullmatch(line)
        if context and m:
            last = f"{context}.{m.group(1)}"
            found[last] = m.group(2).strip()
        else:
            last = ""
    return found


@functools.cache
def _source_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside it, or in the lines right above it, in the class's source."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, block = {}, []
    for line in lines:
        stripped = line.strip()
        field = re.match(r"([a-z_][a-z0-9_]*)\s*:", stripped)
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
        elif field:
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            out[field.group(1)] = " ".join(block + ([trailing] if trailing else []))
            block = []
        else:
            block = []
    return out


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + (" (optional)" if len(inner) < len(args) else "")
    if origin is typing.Literal:
        return " or ".join(f'`{a!r}`'.replace("'", '"') for a in args)
    if origin is tuple:
        return f"array of {_type_name(args[0])}"
    if origin in (dict, Mapping) or (origin is not None and getattr(origin, "__name__", "") == "Mapping"):
        return f"table of {_type_name(args[1])}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.6g}" if "e" not in f"{value:.6g}" else repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{f.name} = {_toml_value(getattr(value, f.name))}"
                               for f in dataclasses.fields(value) if f.init) + "}"
    return str(value)


def _default(f: dataclasses.Field) -> tuple[bool, Any]:
    if f.default is not dataclasses.MISSING:
        return True, f.default
    if f.default_factory is not dataclasses.MISSING:
        return True, f.default_factory()
    return False, None


def _bounds(f: dataclasses.Field) -> str:
    rules = []
    for key, word in (("gt", ">"), ("ge", ">="), ("le", "<=")):
        if key in f.metadata:
            rules.append(f"{word} {f.metadata[key]:g}" if isinstance(f.metadata[key], (int, float))
                         else f"{word} {f.metadata[key]}")
    if f.metadata.get("nonempty"):
        rules.append("not empty")
    return ", ".join(rules)


def _nested(tp: Any) -> tuple[type | None, str]:
    """The section class inside a field's type, and how it appears in TOML (table, array of tables, map)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, "table"
    if origin in (typing.Union, types.UnionType):
        for a in args:
            cls, how = _nested(a)
            if cls:
                return cls, how
    if origin is tuple and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0], "array"
    if args and origin is not typing.Literal and isinstance(args[-1], type) and dataclasses.is_dataclass(args[-1]):
        return args[-1], "map"
    return None, ""


def _section(cls: type, title: str, path: str, doc_path: str, out: list[str], intro: str = "") -> None:
    hints = typing.get_type_hints(cls)
    comments, source = toml_comments(), _source_comments(cls)
    rows, children = [], []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("derived"):  # derived: filled by the config, no key
            continue
        tp = hints[f.name]
        child, how = _nested(tp)
        has_default, default = _default(f)
        if child is not None and how in ("table", "array", "map"):
            children.append((f, child, how, has_default, default))
            continue
        desc = comments.get(f"{doc_path}.{f.name}", "")
        if desc.startswith("\x00"):
            desc = source.get(f.name) or f"See `{desc[1:]}` above."
        desc = desc or source.get(f.name, "")
        shown = ("**required**" if not has_default else
                 "unset" if default is None else f"`{_toml_value(default)}`")
        rows.append([f"`{f.name}`", _type_name(tp), shown, _bounds(f), desc])
    out.append(f"\n### `{title}` {{ #{_anchor(title)} }}\n")
    doc = intro or (inspect.getdoc(cls) or "")
    if doc and not doc.startswith(cls.__name__ + "("):
        out.append(doc + "\n")
    if rows:
        out.append(_table(["key", "type", "default", "bounds", "what it does"], rows))
    for f, child, how, has_default, default in children:
        if how == "table":
            _section(child, f"[{path}.{f.name}]" if path else f"[{f.name}]",
                     f"{path}.{f.name}" if path else f.name,
                     f"{doc_path}.{f.name}" if doc_path else f.name, out)
        elif how == "array":
            sub = f"{path}.{f.name}" if path else f.name
            _section(child, f"[[{sub}]]", sub, f"{doc_path}.{f.name}[]" if doc_path else f"{f.name}[]", out,
                     intro=("One table per item. " + (f"Default: `{_toml_value(default)}`." if has_default
                                                       and default else "")).strip())
        else:
            sub = f"{path}.{f.name}" if path else f.name
            _section(child, f"[{sub}.<name>]", f"{sub}.<name>", f"{doc_path}.{f.name}", out,
                     intro=f"A table of named entries. Default: `{_toml_value(default)}`." if has_default
                     else "A table of named entries.")


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def config_reference() -> str:
    from gateway.policies import registry

    root = _config_root()
    out = [
        "# Configuration reference\n",
        "Generated at build time from the schema: the config's dataclasses (types, defaults and bounds) "
        "and each policy's own table, with each option's description taken from the comments of the "
        "packaged `gateway/config/default.toml`. Every key may be left out (its default applies) except "
        "those marked **required**. How the file is loaded, checked and reloaded: "
        "[Configuration](index.md).\n",
    ]
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        if not f.init or f.metadata.get("derived"):  # derived: filled by the config, no key
            continue
        child, how = _nested(hints[f.name])
        if child is None:
            continue  # the policies mapping: below, from the registry
        if how == "array":
            _section(child, f"[[{f.name}]]", f.name, f"{f.name}[]", out,
                     intro="One table per instance of the pool (at least one).")
        else:
            _section(child, f"[{f.name}]", f.name, f.name, out)
    out.append("\n## Policy tables\n\nEach policy declares its own table, `[policies.<name>]`, in its package; "
               "the registry lists them. A table left out has its defaults.\n")
    for name, cls in sorted(registry.tables().items()):
        _section(cls, f"[policies.{name}]", f"policies.{name}", f"policies.{name}", out)
    from gateway.lab.emulator.settings import EmulatorConfig, FaultsConfig

    out.append("\n## The emulator's tables\n\nRead and checked by `routebalance emulate` and `up` only "
               "(`gateway/lab/emulator/settings.py`); a gateway in front of real servers keeps them unread.\n")
    _section(EmulatorConfig, "[emulator]", "emulator", "emulator", out)
    _section(FaultsConfig, "[instances.faults]", "instances.faults", "instances[].faults", out)
    return "\n".join(out)


RENDERERS = {
    "table": render_table,
    "pivot": render_pivot,
    "json": render_json,
    "claims": render_claims,
    "label_counts": render_label_counts,
    "policies": render_policies,
}


if __name__ == "__main__":  # print the configuration reference (a quick look without a build)
    print(config_reference())

