"""The lesson stays short and fresh: a learner's path per op (README, the op's notebook as executed,
the op page) is at most PATH_WORDS words; every executed notebook printed the commit it ran at and
the fingerprints of the sources it shows (`cookbook.sources`), and they are today's; every results
page a notebook plots was measured on today's sources.

Ops still in the single-header layout (their lesson not yet rewritten on the ladder pattern) are
held to the path budget once they move; their pages recorded before the benchmark wrote
fingerprints are listed by `test_pages_recorded_before_fingerprints`, not failed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cookbook import registry, sources

ROOT = Path(__file__).resolve().parents[1]
PATH_WORDS = 10_000
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# The op each walkthrough teaches (its page is docs/<op>.md).
LESSONS = {"qk_norm": "01_qk_norm", "cross_head_norm": "02_cross_head_norm", "tp_qk_norm": "03_tp_qk_norm",
           "qk_norm_rope": "04_qk_norm_rope", "qk_norm_rope_cache": "06_qk_norm_rope_cache"}
PROVENANCE = re.compile(r"ran at commit (\S+) on (\S+); sources: ((?:\w+ [0-9a-f]{12}(?:, )?)+)")
PAGE_LINK = re.compile(r"docs/results/([\w.-]+)\.md")


def ladder_layout(op: str) -> bool:
    return any(impl.extension is not None for impl in registry.implementations(op))


def words(text: str) -> int:
    return len(text.split())


def notebook_text(path: Path) -> tuple[str, str]:
    """(cell sources, text outputs) of an executed notebook."""
    cells = json.loads(path.read_text())["cells"]
    source = "\n".join("".join(c["source"]) for c in cells)
    outputs = []
    for cell in cells:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            outputs.append("".join(text))
    return source, "\n".join(outputs)


def learner_path_words(op: str) -> int:
    source, outputs = notebook_text(ROOT / "notebooks" / f"{LESSONS[op]}.ipynb")
    return sum(map(words, ((ROOT / "README.md").read_text(), source, outputs, (ROOT / "docs" / f"{op}.md").read_text())))


@pytest.mark.parametrize("op", [op for op in LESSONS if ladder_layout(op)])
def test_learner_path_is_short(op):
    total = learner_path_words(op)
    assert total <= PATH_WORDS, f"{op}: README + {LESSONS[op]}.ipynb (as executed) + docs/{op}.md = {total} words"


def provenance(path: Path) -> tuple[str, dict[str, str]] | None:
    _, outputs = notebook_text(path)
    found = PROVENANCE.search(outputs)
    if found is None:
        return None
    prints = dict(item.split(" ") for item in found.group(3).split(", "))
    return found.group(1), prints


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_ran_on_todays_sources(notebook):
    found = provenance(notebook)
    assert found is not None, f"{notebook.name}: no 'ran at commit ...; sources: ...' line (walkthrough.setup prints it)"
    commit, prints = found
    stale = {op: fp for op, fp in prints.items() if sources.fingerprint(op) != fp}
    assert not stale, (f"{notebook.name} ran at {commit} on sources of {sorted(stale)} that have changed since: run it "
                       f"again (`python tools/run_notebook.py notebooks/{notebook.stem}.py`, on a GPU where it was)")


def plotted_pages(notebook: Path) -> list[Path]:
    _, outputs = notebook_text(notebook)
    pages = dict.fromkeys(ROOT / "docs" / "results" / f"{stem}.json" for stem in PAGE_LINK.findall(outputs))
    return [page for page in pages if page.is_file()]


def page_ops(page: Path) -> list[str]:
    rows = json.loads(page.read_text()).get("rows", [])
    return sorted({row["op"] for row in rows if isinstance(row, dict) and "op" in row}) or \
        [max((op for op in registry.ops() if page.stem.startswith(op + "_")), key=len, default=page.stem)]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_plotted_pages_were_measured_on_todays_sources(notebook):
    for page in plotted_pages(notebook):
        meta = json.loads(page.read_text()).get("metadata", {})
        for op in page_ops(page):
            if op not in registry.ops():
                continue
            recorded = meta.get("sources", {}).get(op)
            if recorded is None:
                assert not ladder_layout(op), (f"{page.name} (plotted by {notebook.name}) was recorded before the "
                                               f"benchmark wrote fingerprints: run `python -m cookbook bench --ops {op}`")
                continue
            assert recorded == sources.fingerprint(op), (
                f"{page.name} (plotted by {notebook.name}) measured {op}'s sources of {meta.get('commit')}, which have "
                f"changed since: run `python -m cookbook bench --ops {op} --results-dir docs/results` on a GPU")


def test_pages_recorded_before_fingerprints():
    """The pages of record of ops still in the single-header layout that predate fingerprints: listed,
    so that moving an op to the ladder layout shows what must be measured again."""
    old = []
    for notebook in NOTEBOOKS:
        for page in plotted_pages(notebook):
            if "sources" not in json.loads(page.read_text()).get("metadata", {}):
                old.append(page.name)
    ladder = [name for name in old if any(op in registry.ops() and ladder_layout(op)
                                          for op in page_ops(ROOT / "docs" / "results" / name))]
    assert not ladder, f"pages of ops in the ladder layout recorded before fingerprints: {ladder}"


def test_fingerprint_follows_every_source(monkeypatch):
    """An edit to a kernel, a shared header, the contract or a lead changes the fingerprint."""
    before = sources.fingerprint("qk_norm")
    for relative in ("kernels_cuda/qk_norm/v3_vectors_in_registers.cuh", "kernels_cuda/include/common.cuh",
                     "cookbook/ops/qk_norm.py"):
        assert Path(relative) in sources.files("qk_norm"), relative
    impl = registry.get("qk_norm", "cuda_v3")
    changed = [registry.Impl(**{**impl.__dict__, "lead": impl.lead + " (edited)"}) if i is impl else i
               for i in registry.IMPLEMENTATIONS["qk_norm"]]
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "qk_norm", changed)
    assert sources.fingerprint("qk_norm") != before
