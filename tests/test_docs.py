"""The docs hold together: every relative link and ``#anchor`` in README.md, docs/*.md and benchmarks/README.md
resolves (the file exists; the anchor is a GitHub heading slug of its target), every config default the docs quote
is the default of the config that ``ditrun`` composes from ``ditrun/conf``, and each measured number is stated in
one doc only."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ditrun.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose(text: str) -> str:
    """``text`` with fenced code blocks blanked (their lines kept, so line numbers still hold)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading shows its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, repeats numbered as GitHub numbers them (``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link in ``path``'s prose (web and mail links left out)."""
    found = []
    for number, line in enumerate(prose(path.read_text()).splitlines(), 1):
        for match in LINK.finditer(CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)):
            target = line[match.start(1) : match.end(1)]
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                found.append((number, target))
    return found


def broken_links(doc: Path) -> list[str]:
    broken = []
    for number, target in links(doc):
        file_part, _, anchor = target.partition("#")
        target_path = (doc.parent / file_part).resolve() if file_part else doc
        if not target_path.exists():
            broken.append(f"{doc.name}:{number}: {target}: no such file")
        elif anchor and target_path.suffix == ".md" and anchor not in anchors(target_path):
            broken.append(f"{doc.name}:{number}: {target}: no heading with that anchor in {target_path.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_and_anchor_resolves(doc):
    broken = broken_links(doc)
    assert not broken, "\n".join(broken)


def test_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "b.md").write_text("# Many nodes\n\n## Many nodes\n")
    doc = tmp_path / "a.md"
    doc.write_text(
        "# Top\n[ok](b.md#many-nodes-1) [self](#top) [web](https://example.com/x#y) `[code](gone.md)`\n"
        "[gone](gone.md) [no heading](b.md#many-nodes-2) [no self](#bottom)\n```\n[fenced](gone.md)\n```\n"
    )
    assert broken_links(doc) == [
        "a.md:3: gone.md: no such file",
        "a.md:3: b.md#many-nodes-2: no heading with that anchor in b.md",
        "a.md:3: #bottom: no heading with that anchor in a.md",
    ]


def test_the_slugs_are_githubs():
    assert (
        slug("Guarantees: nothing lost, nothing doubled, nothing escapes")
        == "guarantees-nothing-lost-nothing-doubled-nothing-escapes"
    )
    assert slug("ditrun against diffusers, one forward") == "ditrun-against-diffusers-one-forward"
    assert slug("The CLI's DiT time per edit, per preset") == "the-clis-dit-time-per-edit-per-preset"
    assert slug("Is the edit right? Against the correct edit") == "is-the-edit-right-against-the-correct-edit"
    assert slug("`ditrun report` and [the table](x.md)") == "ditrun-report-and-the-table"


# -- defaults ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config():
    """The default run config, with Hydra's record of the group choices it took (``hydra.runtime.choices``)."""
    register_configs()
    with initialize_config_module("ditrun.conf", version_base="1.3"):
        return compose("config", return_hydra_config=True)


def quoted_value(text: str):
    """A default as the docs write it, as the config holds it: ``unset`` (or a path under an environment
    variable, worked out at run time) is None; true/false, numbers and ``[]`` are themselves."""
    text = text.strip().strip("`").strip()
    if text.startswith("unset") or text.startswith("$"):
        return None
    if text in ("true", "false"):
        return text == "true"
    if text == "[]":
        return []
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def table_rows(text: str) -> list[list[list[str]]]:
    """Every markdown table of ``text``: its rows (the header first, the rule left out) of cells."""
    tables, rows = [], []
    for line in prose(text).splitlines() + [""]:
        if line.lstrip().startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def quoted_defaults(doc: Path) -> list[tuple[str, str, str]]:
    """(where, config key, the default as written) for each default that ``doc`` quotes of a ditrun key:
    rows of "key | default" tables, rows marked "(default)" in a table of one key's values (first header
    ``key=``), and inline "`key` (default V", "`key` (`V`: what it means)", "`key`: `V` (default)" and "`key=V`
    by default"."""
    text = doc.read_text()
    found = []
    for rows in table_rows(text):
        header = [c.lower() for c in rows[0]]
        if header[:2] == ["key", "default"]:
            for row in rows[1:]:
                keys = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", row[0]) or re.findall(r"`([a-z_]+)`", row[0])
                found.append((f"{doc.name}: {row[0]}", keys[-1], row[1]))
        key = re.fullmatch(r"`([a-z_.]+)=`", rows[0][0])
        if key:
            for row in rows[1:]:
                marked = re.fullmatch(r"`([^`]+)` \(default\)", row[0])
                if marked:
                    found.append((f"{doc.name}: {row[0]}", key.group(1), marked.group(1)))
    flat = " ".join(prose(text).split())
    inline = [
        r"`([a-z_]+(?:\.[a-z_]+)+)` (?:\w+ )?\((?:ditrun's )?default (`[^`]+`|[^ ;:),]+)",
        r"`([a-z_]+(?:\.[a-z_]+)+)` \(`([^`]+)`: ",
        r"`([a-z_]+(?:\.[a-z_]+)+)`: `([^`]+)` \(default\)",
        r"`([a-z_]+(?:\.[a-z_]+)+)=([^`]+)` by default",
    ]
    for pattern in inline:
        found += [(f"{doc.name}: {m.group(0)}", m.group(1), m.group(2)) for m in re.finditer(pattern, flat)]
    return [(where, key, value) for where, key, value in found if not key.startswith("hydra.")]


def config_default(config, key: str):
    value = OmegaConf.select(config, key, throw_on_missing=False)
    if OmegaConf.is_config(value) and "name" in value:  # a group: the docs name the choice
        value = value.name
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_the_docs_quote_defaults():
    """The patterns find the quotes they are meant to find (so the next test cannot pass by finding none)."""
    quoted = {key for doc in DOCS for _, key, _ in quoted_defaults(doc)}
    assert {
        "layout.head_groups",
        "wandb.mode",
        "transport.node_size",
        "transport",
        "metrics.quality",
        "metrics.warmup_edits",
        "workload.guidance_scale",
        "precision.backend",
        "model.compile",
    } <= quoted, quoted


def test_the_defaults_quoted_in_the_docs_are_the_configs(config):
    wrong = []
    for doc in DOCS:
        for where, key, written in quoted_defaults(doc):
            key = key if "." in key or key not in config.hydra.runtime.choices else f"{key}.name"
            if OmegaConf.select(config, key, default="<absent>") == "<absent>":
                wrong.append(f"{where}: {key} is not a config key")
            elif config_default(config, key) != quoted_value(written):
                wrong.append(f"{where}: the config's default is {config_default(config, key)!r}")
    assert not wrong, "\n".join(wrong)


def test_the_readmes_groups_list_the_config_files_and_mark_the_default(config):
    """README's table of config groups: each group's choices are the YAML files of ``ditrun/conf/<group>``, and
    the one it calls the default is the one the config takes."""
    table = next(rows for rows in table_rows((ROOT / "README.md").read_text()) if rows[0][:2] == ["group", "choices"])
    for row in table[1:]:
        group = row[0].strip("`")
        listed = re.findall(r"`([^`]+)`", re.sub(r"\[[^\]]*\]\([^)]*\)", "", row[1]))
        assert sorted(listed) == sorted(p.stem for p in (ROOT / "ditrun" / "conf" / group).glob("*.yaml")), group
        marked = re.search(r"`([^`]+)` \(the default", row[1])
        if marked:
            assert marked.group(1) == config.hydra.runtime.choices[group], group


# -- each measured number in one doc -------------------------------------------------------------------------

DECIMAL = r"(?<![\w.])\d+\.\d+(?![\w.]*\d)"  # 29.7, 0.511; not a version (2.11.0), a name (fp8.1) or 5.72e-2's 2
UNIT = r"(?:\s?[-–]\s?\d+(?:\.\d+)?)?(?:x\b|%|\s?(?:dB|ms|us|s|min|MB|MiB|GB|GiB|TB/s|TFLOP/s|W|MHz|M)\b)"
MEASURED_IN_PROSE = re.compile(DECIMAL + f"(?={UNIT})")
MEASURED_IN_TABLE = re.compile(DECIMAL)
INDENTED_CODE = re.compile(r"^(?: {4}|\t)")
GENERATED = re.compile(r"<!-- .*: (begin|end) generated")


def measured_numbers(text: str) -> list[tuple[int, str, bool]]:
    """(line number, number, in prose?) of each measured number ``text`` states (see the test below for the rule)."""
    found, generated, after_blank, indented = [], False, True, False
    for number, line in enumerate(prose(text).splitlines(), 1):
        marker = GENERATED.search(line)
        if marker:
            generated = marker.group(1) == "begin"
        indented = bool(INDENTED_CODE.match(line)) and (indented or after_blank)
        after_blank = not line.strip()
        if generated or indented:
            continue
        line = re.sub(r"\]\([^)]*\)", "]", CODE_SPAN.sub("", line))  # inline code and link targets say no measure
        in_table = line.lstrip().startswith("|")
        for match in (MEASURED_IN_TABLE if in_table else MEASURED_IN_PROSE).finditer(line):
            value = match.group(0)
            digits = value.replace(".", "").lstrip("0")
            if len(digits) >= 3 and float(value) not in (1.0, 100.0):
                found.append((number, value, not in_table))
    return found


def repeated_numbers(docs: list[Path]) -> list[str]:
    stated: dict[str, list[tuple[str, int, bool]]] = {}
    for doc in docs:
        for number, value, in_prose in measured_numbers(doc.read_text()):
            stated.setdefault(value, []).append((doc.name, number, in_prose))
    repeated = []
    for value, places in sorted(stated.items()):
        if len({name for name, _, _ in places}) > 1 and any(in_prose for _, _, in_prose in places):
            repeated.append(f"{value}: " + ", ".join(f"{name}:{line}" for name, line, _ in places))
    return repeated


def test_no_measured_number_is_stated_in_two_docs():
    """A measured number lives in the one doc section that owns it; the others link to that section.

    A measured number here is a decimal (digits, a point, digits) of at least three significant digits (two, as in
    0.5 or 2.5, coincide too often to mean a repeat), other than 1 and 100 ("identical", "all": SSIM 1.0000, 100.00%),
    stated either in prose followed by a unit (dB, %, x, s, ms, us, min, MB, MiB, GB, GiB, TB/s, TFLOP/s, W, MHz, M;
    a range such as 26.5-29.3 dB gives both ends the unit) or in a table cell, whose unit is in the header. Skipped:
    fenced and indented code blocks (commands and their output), inline code (settings such as
    ``cache.threshold=0.3``, versions), link targets, and blocks a script generates between ``<!-- ...: begin
    generated`` and ``end generated`` markers (they are printed from a results file, as docs/SCALING.md's are).
    A number fails when two docs state it and at least one of them in prose: two tables that share a value are two
    measurements that agree, while prose that quotes a number is what repeats it."""
    repeated = repeated_numbers(DOCS)
    assert not repeated, "measured numbers stated in more than one doc:\n" + "\n".join(repeated)


def test_a_repeated_number_is_found(tmp_path):
    owner, quoting, other = tmp_path / "owner.md", tmp_path / "quoting.md", tmp_path / "other.md"
    owner.write_text("| precision | % of BF16 |\n| --- | --- |\n| fp8 | 98.7 |\n\nIt took 640.9 ms.\n")
    quoting.write_text(
        "FP8 keeps 98.6-98.7% ([owner](owner.md)).\n`cache.threshold=640.9 ms` 2.5 dB 1.0000 x\n\n    640.9 ms\n"
        "<!-- gen: begin generated -->\nIt took 640.9 ms.\n<!-- gen: end generated -->\n"
    )
    other.write_text("| run | ms |\n| --- | --- |\n| a | 640.9 |\n")
    assert measured_numbers(quoting.read_text()) == [(1, "98.6", True), (1, "98.7", True)]
    assert repeated_numbers([owner, quoting]) == ["98.7: owner.md:3, quoting.md:1"]
    assert repeated_numbers([owner, other]) == ["640.9: owner.md:5, other.md:3"]
    assert repeated_numbers([other, tmp_path / "other.md"]) == []


def glossary_of_config() -> dict[str, str]:
    """The glossary at the top of ``ditrun/config.py``'s docstring: word -> meaning, whitespace joined."""
    import ditrun.config

    text = ditrun.config.__doc__.split("Glossary (docs/GLOSSARY.md):", 1)[1]
    entries: dict[str, str] = {}
    word = ""
    for line in text.strip().splitlines():
        if line.startswith("    "):
            entries[word] += " " + line.strip()
        else:
            word, meaning = line.split(": ", 1)
            entries[word] = meaning
    return {word: meaning.replace("``", "`") for word, meaning in entries.items()}


def test_the_glossary_of_the_docs_is_the_configs():
    lines = (ROOT / "docs" / "GLOSSARY.md").read_text().splitlines()
    rows = [line.strip("| ").split(" | ", 1) for line in lines if line.startswith("| ")][2:]  # less header and rule
    docs = dict(rows)
    assert len(docs) >= 10 and docs == glossary_of_config()
