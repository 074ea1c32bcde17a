"""The measured tables of docs/results.md, written from the results that produced them, never typed.

A table lives between `<!-- NAME:start -->` and `<!-- NAME:end -->`; `update_section` replaces what
lies between. The Table 1 scripts (`paper_table.py`, `translation_table.py`) write their own with
`--doc`; this script writes a `blockdecode bench` run's from its bench.json:

    .venv/bin/blockdecode bench --preset core && .venv/bin/python benchmarks/results_doc.py benchmarks/results/core
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from blockdecode.bench import acceptance_markdown, batch_markdown, core_markdown, markdown, sampling_markdown
from blockdecode.core.io import write_text

DOC = Path(__file__).parents[1] / "docs" / "results.md"


def update_section(doc: Path, name: str, text: str) -> None:
    """Replace what lies between `<!-- {name}:start -->` and `<!-- {name}:end -->` in `doc`."""
    start_mark, end_mark = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    old = doc.read_text()
    if start_mark not in old or end_mark not in old:
        raise ValueError(f"{doc} has no {start_mark} ... {end_mark} section")
    head, rest = old.split(start_mark, 1)
    write_text(doc, f"{head}{start_mark}\n{text}\n{end_mark}{rest.split(end_mark, 1)[1]}")


def bench_tables(report: dict) -> dict[str, str]:
    """A bench run's tables by section: the methods' (an encoder-decoder's run is the paper's Table 4,
    with a section of its own), the approximate rules' if any were measured, the code model's sampling
    and batch rows, and the scripted-drafter study's when it ran alone (`--preset core`)."""
    tables = {}
    if report["methods"]:
        name = "translation-speed-table" if report.get("task") == "translation" else "bench-table"
        tables[name] = markdown(report)
    if report["config"]["acceptance"]:
        tables["acceptance-table"] = acceptance_markdown(report)
    if report.get("sampling") and report.get("task") != "translation":
        tables["sampling-table"] = sampling_markdown(report["sampling"])
    if report.get("batches") and report.get("task") != "translation":
        tables["batch-table"] = batch_markdown(report["batches"])
    if "system_ceiling" in report and not report["config"]["methods"]:
        tables["core-table"] = core_markdown(report["system_ceiling"])
    return tables


def write_bench_tables(results: Path, doc: Path = DOC) -> list[str]:
    """Write the tables of the bench run in `results` (its bench.json) into `doc`; their names."""
    tables = bench_tables(json.loads((Path(results) / "bench.json").read_text()))
    for name, text in tables.items():
        update_section(doc, name, text)
    return list(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a `blockdecode bench` results folder (its --out), holding bench.json")
    parser.add_argument("--doc", default=str(DOC), help="the markdown file to write into (default docs/results.md)")
    args = parser.parse_args()
    names = write_bench_tables(Path(args.results), Path(args.doc))
    print(f"wrote {', '.join(names) or 'no table'} into {args.doc}")


if __name__ == "__main__":
    main()
