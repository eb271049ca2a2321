"""The one results table: a long format, one row per number.

Columns, in this order (the core seven are always there; the others when they apply):

============  ========  ===========================================================
column        dtype     meaning
============  ========  ===========================================================
tag           str       a session's label (`ProbeSession.tag`)
checkpoint    str       study: checkpoint name (``step{N}``)
step          Int64     study: training step
window        str       study: ``early``, ``middle``, ``late`` or ``late-early``
rank          Int64     study: rank k of Q_T
probe         str       ``residual``, ``gradient``, ``attention``, ``activation``,
                        ``embedding``, ``checkpoint``, ...
hook          str       full TransformerLens hook name (``blocks.3.hook_resid_pre``)
site          str       the site kind (``resid_pre``, ``attn_in``, ...)
layer         Int64     block index (0 for ``hook_embed``)
head          Int64     attention head, <NA> elsewhere (``table["head"]``: ``table.head``
                        is the DataFrame method)
component     str       linear probes: ``full``, ``tangent`` or ``normal`` part
statistic     str       e.g. ``tangent_share``, ``energy_ratio``, ``p_value``
value         float64   the number
ci_low        float64   lower end of its 95 % interval over tokens, where there is one
ci_high       float64   upper end
============  ========  ===========================================================

Every ``statistic`` is a name in `tangentlens.core.catalogue` (docs/STATISTICS.md): `write`
refuses a table with a name the catalogue lacks; `frame` and `read` take any name.

One writer (`write`: CSV and JSON, atomically), one reader (`read`: strict, a damaged
file is a `CorruptFileError` naming the file and line, never a partial table) and one
filter (`select`), used by the report, the depth profile and the CLI.

A CSV cut at a row boundary, or inside its last number, still parses as a table; so the
writer records what it wrote in ``{name}.meta.json`` beside the tables (the row count and
the sha256 of each file's bytes), and the reader checks a table against that record when
there is one. A table someone made by hand has none and is read on its own terms.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from . import catalogue
from .errors import CorruptFileError, MissingFileError, UsageError
from .files import read_json, write_text

__all__ = ["COLUMNS", "CORE", "frame", "read", "row", "select", "write"]

COLUMNS = (
    "tag",
    "checkpoint",
    "step",
    "window",
    "rank",
    "probe",
    "hook",
    "site",
    "layer",
    "head",
    "component",
    "statistic",
    "value",
    "ci_low",
    "ci_high",
)
CORE = ("probe", "hook", "site", "layer", "head", "statistic", "value")
_TEXT = ("tag", "checkpoint", "window", "probe", "hook", "site", "component", "statistic")
_INT = ("step", "rank", "layer", "head")
_FLOAT = ("value", "ci_low", "ci_high")
RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"
META_SUFFIX = ".meta.json"


def _columns(present: Iterable[str]) -> list[str]:
    present = set(present)
    unknown = present - set(COLUMNS)
    if unknown:
        raise UsageError(f"unknown results columns {sorted(unknown)}; the schema has {COLUMNS}.")
    return [c for c in COLUMNS if c in present or c in CORE]


def frame(
    rows: Sequence[dict[str, Any]] | pd.DataFrame, columns: Iterable[str] = ()
) -> pd.DataFrame:
    """A results table from row dicts (or a DataFrame), with the schema's order and dtypes.

    Columns are the core ones, those the rows use, and ``columns``."""
    data = pd.DataFrame(rows) if not isinstance(rows, pd.DataFrame) else rows.copy()
    order = _columns([*data.columns, *columns])
    for col in order:
        if col not in data.columns:
            data[col] = None
    data = data[order]
    for col in order:
        if col in _INT:
            data[col] = pd.array(
                [None if _missing(v) else int(v) for v in data[col]], dtype="Int64"
            )
        elif col in _FLOAT:
            data[col] = pd.to_numeric(data[col], errors="raise").astype("float64")
        else:
            data[col] = data[col].astype(object).where(data[col].notna(), None)
    return data.reset_index(drop=True)


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


# ----------------------------------------------------------------------------- write
def write(table: pd.DataFrame, folder: str | Path, name: str = "results") -> tuple[Path, Path]:
    """Write ``folder/{name}.csv`` and ``.json`` atomically; returns both paths.

    A statistic missing from `tangentlens.core.catalogue` is a `UsageError` naming it, and
    nothing is written (register it with ``tangentlens.core.catalogue.register``)."""
    table = frame(table)
    catalogue.check_names(table["statistic"].unique(), f"writing {Path(folder) / name}")
    folder = Path(folder)
    csv_text = table.to_csv(index=False, na_rep="")
    records = [
        {
            k: (None if _missing(v) else (v.item() if hasattr(v, "item") else v))
            for k, v in r.items()
        }
        for r in table.to_dict("records")
    ]
    json_text = json.dumps(records, allow_nan=True) + "\n"
    meta = {
        "rows": len(table),
        "sha256": {
            f"{name}.{kind}": _sha256(text.encode())
            for kind, text in (("csv", csv_text), ("json", json_text))
        },
    }
    # The record goes last and is removed first: a run killed in between leaves tables
    # without a record (read unverified), never a record that condemns good tables.
    (folder / f"{name}{META_SUFFIX}").unlink(missing_ok=True)
    paths = (
        write_text(folder / f"{name}.csv", csv_text),
        write_text(folder / f"{name}.json", json_text),
    )
    write_text(folder / f"{name}{META_SUFFIX}", json.dumps(meta, indent=2) + "\n")
    return paths


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- read
def _convert(col: str, text: Any, where: str) -> Any:
    if col in _TEXT:
        if text is None or text == "":
            return None
        if not isinstance(text, str):
            raise CorruptFileError(f"{where}: column {col} holds {text!r}, not text.")
        return text
    if text is None or text == "":
        return None if col in _INT else math.nan
    try:
        number = float(text)
    except (TypeError, ValueError):
        raise CorruptFileError(f"{where}: column {col} holds {text!r}, not a number.") from None
    if col in _INT:
        if not number.is_integer():
            raise CorruptFileError(f"{where}: column {col} holds {text!r}, not an integer.")
        return int(number)
    return number


def _from_records(
    header: list[str], records: Iterable[tuple[int, list[Any]]], path: Path
) -> pd.DataFrame:
    try:
        order = _columns(header)
    except UsageError as err:
        raise CorruptFileError(
            f"{path} is not a tangentlens results table ({err}); re-create it with "
            "`tangentlens study` or `tangentlens probe`."
        ) from None
    missing = [c for c in CORE if c not in header]
    if missing:
        raise CorruptFileError(
            f"{path} is not a tangentlens results table: it lacks the columns {missing}; "
            "re-create it with `tangentlens study` or `tangentlens probe`."
        )
    rows = []
    for line, values in records:
        where = f"{path}, line {line}"
        if len(values) != len(header):
            raise CorruptFileError(
                f"{where} has {len(values)} fields where the header has {len(header)}; the "
                "file is damaged: re-create it (or restore it from the JSON beside it)."
            )
        rows.append({c: _convert(c, v, where) for c, v in zip(header, values, strict=True)})
    return frame(pd.DataFrame(rows, columns=header), order)


def _read_csv(path: Path, data: bytes) -> pd.DataFrame:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorruptFileError(f"{path} is not UTF-8 text ({err.reason}); re-create it.") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None:
            raise CorruptFileError(f"{path} is empty; re-create it.")
        records = [(reader.line_num, row) for row in reader]
    except csv.Error as err:
        raise CorruptFileError(
            f"{path}, line {reader.line_num}: {err}; the file is damaged: re-create it."
        ) from None
    return _from_records(header, records, path)


def _read_json(path: Path) -> pd.DataFrame:
    data = read_json(path, list, fix="re-create it")
    if not all(isinstance(r, dict) for r in data):
        raise CorruptFileError(f"{path} is not a list of result records; re-create it.")
    header = list(data[0]) if data else list(CORE)
    records = []
    for i, record in enumerate(data):
        if set(record) != set(header):
            raise CorruptFileError(f"{path}, record {i}: its keys differ from the first record's.")
        records.append((i, [record[c] for c in header]))
    return _from_records(header, records, path)


def _verify(path: Path, data: bytes, table: pd.DataFrame) -> None:
    """Check a table against the record its writer left beside it (if any): a table
    cut short or altered after writing is a `CorruptFileError`, not a quieter table."""
    meta_path = path.with_name(path.stem + META_SUFFIX)
    if not meta_path.is_file():
        return
    fix = "the file is damaged: delete it and re-run the command that made it"
    meta = read_json(meta_path, dict, fix=f"delete it and {path.name}, and re-run")
    rows, digest = meta.get("rows"), meta.get("sha256", {})
    wanted = digest.get(path.name) if isinstance(digest, dict) else None
    if not isinstance(rows, int) or not isinstance(wanted, str):
        raise CorruptFileError(
            f"{meta_path} lacks the row count or the sha256 of {path.name}; delete it and "
            f"{path.name}, and re-run the command that made them."
        )
    if len(table) != rows:
        raise CorruptFileError(
            f"{path} holds {len(table)} rows where its writer wrote {rows} (cut short or "
            f"extended, per {meta_path.name}); {fix}."
        )
    if _sha256(data) != wanted:
        raise CorruptFileError(
            f"{path} differs from what its writer wrote (its sha256 is not the one in "
            f"{meta_path.name}: a changed or cut value); {fix}."
        )


def read(path: str | Path) -> pd.DataFrame:
    """Read a results table: a folder (its ``results.csv``, else ``results.json``) or a
    ``.csv`` / ``.json`` file. Damage of any kind is a `CorruptFileError`."""
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in (RESULTS_CSV, RESULTS_JSON) if (path / n).is_file()), None)
        if found is None:
            raise MissingFileError(
                f"{path} has no {RESULTS_CSV}; pass the --out folder of `tangentlens study` "
                "or `tangentlens probe`."
            )
        path = found
    elif not path.is_file():
        raise MissingFileError(f"{path} does not exist; pass a results folder or results.csv.")
    data = path.read_bytes()
    table = _read_json(path) if path.suffix.lower() == ".json" else _read_csv(path, data)
    _verify(path, data, table)
    return table


# ----------------------------------------------------------------------------- select
NamesFilter = str | Sequence[str] | Callable[[str], bool] | None


def select(table: pd.DataFrame, *, names_filter: NamesFilter = None, **where: Any) -> pd.DataFrame:
    """The rows of ``table`` that match every criterion; nothing else is dropped.

    ``names_filter`` selects by ``hook`` with TransformerLens' vocabulary (a name, a list
    of names, or a callable on the name). Each keyword is a column and a value or a
    list of values (``statistic="energy_ratio"``, ``layer=[0, 1]``, ``head=None`` for
    rows without a head).
    """
    keep = pd.Series(True, index=table.index)
    if names_filter is not None:
        hooks = table["hook"]
        if callable(names_filter):
            keep &= hooks.map(lambda h: bool(h is not None and names_filter(h)))
        else:
            names = [names_filter] if isinstance(names_filter, str) else list(names_filter)
            keep &= hooks.isin(names)
    for col, wanted in where.items():
        if col not in table.columns:
            raise UsageError(f"select: no column {col!r}; the table has {list(table.columns)}.")
        values = wanted if isinstance(wanted, (list, tuple, set)) else [wanted]
        match = pd.Series(False, index=table.index)
        for v in values:
            match |= table[col].isna() if v is None else (table[col] == v).fillna(False)
        keep &= match
    return table[keep.astype(bool)]


_WHERE = ("hook", "site", "layer", "head")


def row(probe: str, site: Any, statistic: str, value: Any, **extra: Any) -> dict[str, Any]:
    """One row of the schema: the probe, where it was measured, the statistic and its
    value, then ``extra`` columns (``rank``, ``component``, ``ci_low`` ...; an extra
    ``head`` names a head of a site that has none).

    ``site`` is a `tangentlens.hooks.Site` (anything with ``hook_name``, ``kind``,
    ``layer`` and ``head``: this floor cannot import the hooks) or None for a statistic of
    no one site. Every writer of rows builds them here, so a site's four columns are
    filled the same way in a probe's table, a study's and an intervention's."""
    where = (None,) * 4 if site is None else (site.hook_name, site.kind, site.layer, site.head)
    return {
        "probe": probe,
        **dict(zip(_WHERE, where, strict=True)),
        "statistic": statistic,
        "value": value,
        **extra,
    }
