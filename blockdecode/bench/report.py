"""What a benchmark run leaves behind: the environment it ran in, bench.json, the PNGs and the
markdown tables (the documentation's tables are generated from these, never typed; the package
itself writes only into the run's folder)."""

from __future__ import annotations

import platform
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from blockdecode.bench import batches
from blockdecode.core import hardware, plots
from blockdecode.core.io import saving_folder, write_json, write_text


def cpu_name() -> str:
    """The CPU's model name, or what the platform says where /proc/cpuinfo gives none."""
    return hardware.cpu_name() or platform.processor() or platform.machine()


def package_version() -> str:
    try:
        return version("blockdecode")
    except PackageNotFoundError:  # run from a source tree, not installed
        return "source tree"


def environment(dtype: str, device: str) -> dict:
    import transformers

    return {
        "dtype": dtype,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # AVX2 has no native bf16; AVX512 may
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blockdecode": package_version(),
    }


def write_results(report: dict, out: Path, plot: Callable[[dict, Path], None]) -> None:
    """A study's `report` as JSON at `out`, and `plot`'s figure of it beside it (the same name, .png)."""
    write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def write_report(report: dict, out: Path) -> None:
    """bench.json, the plots and table.md in `out`, replacing an earlier run's as a whole: a run
    interrupted while writing leaves the earlier set, never part of each (`io.saving_folder`)."""
    with saving_folder(Path(out), "bench.json", replaces=("table.md", *plots.BENCH_PLOTS)) as staging:
        plots.bench(report, staging)
        tables = [markdown(report), acceptance_markdown(report)] if report["methods"] else []
        if report.get("sampling"):
            tables.append(sampling_markdown(report["sampling"]))
        if report.get("batches"):
            tables.append(batch_markdown(report["batches"]))
        if "system_ceiling" in report:
            tables.append(core_markdown(report["system_ceiling"]))
        write_text(staging / "table.md", "\n\n".join(tables) + "\n")
        write_json(staging / "bench.json", report)


def _header(report: dict) -> str:
    env, cfg = report["environment"], report["config"]
    return (
        f"{env['dtype']}, {env.get('device', 'cpu')}, {env['threads']} threads, {env['cpu']}"
        f"{' (' + env['cpu_capability'] + ')' if env.get('cpu_capability') else ''}; torch {env['torch']}, "
        f"transformers {env['transformers']}; {len(report['prompts'])} prompts x {cfg['repeats']} "
        f"repeats, {cfg['new_tokens']} new tokens each."
    )


def identical(r: dict) -> str:
    """yes; "ties (n/N)" when every difference of an exact method starts at a near-tie (greedy's
    own top-2 gap within the dtype's rounding); NO for a real divergence; or approximate."""
    if r["identical_to_greedy"]:
        return "yes"
    if not r["exact_method"]:
        return "no (approximate)"
    found = r.get("divergences", [])
    if found and all(d["near_tie"] for d in found):
        return f"ties ({len(found)}/{len(r['outputs'])})"
    return "NO"


def markdown(report: dict) -> str:
    """The benchmark table: one row per method, exact rows first, then the approximate ones."""
    lines = [
        _header(report),
        "",
        "| method | tokens/s | speedup | calls/token | mean block | ceiling | efficiency | loop ms/call | identical "
        "| chrF | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(report["methods"].items(), key=lambda kv: not kv[1]["exact_method"])
    for name, r in rows:
        block = f"{r['mean_block_size']:.2f}" if "mean_block_size" in r else "-"
        ceiling = f"{r['ceiling']:.2f}x" if "ceiling" in r else "-"
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        same = identical(r)
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['calls_per_token']:.3f} | {block} | "
            f"{ceiling} | {eff} | {r['overhead_ms_per_call']:.2f} | {same} | {r['chrf']:.1f} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def sampling_markdown(sampled: dict) -> str:
    """Sampling at each temperature: blockwise chains verified by speculative sampling against
    transformers' own sampling with the same settings (same distribution, other draws)."""
    lines = [
        "Sampling: speedup over transformers' sampling with the same settings.",
        "",
        "| settings | method | tokens/s | speedup | tokens/call |",
        "|---|---|---|---|---|",
    ]
    for entry in sampled.values():
        for name, r in entry["methods"].items():
            lines.append(
                f"| {entry['settings']} | {name} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                f"{r['tokens_per_call']:.2f} |"
            )
    return "\n".join(lines)


def batch_markdown(rows: list[dict]) -> str:
    """Batches against transformers' batched greedy on the same padded batch: speedup is greedy's
    calls over ours, divided by what one of our calls costs against one of greedy's."""
    lines = [
        "Batches: speedup over transformers' batched greedy on the same left-padded batch, one chain a row. "
        "A batch makes as many calls as its slowest row needs, and each call scores rows x k tokens "
        "(call cost: one call's seconds over one of greedy's).",
        "",
        "| batch | drafter | k | tokens/s | speedup | calls (greedy) | slowest row's calls | row mean block "
        "| call cost | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['drafter']} ({r['plan']}) | {r['k']} | {r['tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}x | {r['calls']} ({r['greedy_calls']}) | {r['slowest_row_calls']} | "
            f"{r['row_mean_block']:.2f} | {r['call_cost']:.2f} | {batches.identical(r)} |"
        )
    return "\n".join(lines)


def acceptance_markdown(report: dict) -> str:
    """Exact and each relaxed rule at each k: how much faster, and what it costs in quality
    against exact greedy (the paper's Top-2 / Top-3 rows)."""
    rows = [r for r in report["methods"].values() if r["family"] == "heads"]
    if not any(not r["exact_method"] for r in rows):
        return "(no approximate rule was measured: run `blockdecode bench --acceptance topk:2,...`)"
    greedy = report["methods"]["greedy"]
    lines = [
        f"Greedy's own text has loss {greedy['loss']:.3f} nats/token under the base model.",
        "",
        "| acceptance | k | mean block | speedup | token agreement | chrF | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["acceptance"] != "exact", r["acceptance"], r["k"])):
        lines.append(
            f"| {r['acceptance']} | {r['k']} | {r['mean_block_size']:.2f} | {r['speedup']:.2f}x | "
            f"{r['token_agreement']:.3f} | {r['chrf']:.1f} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def core_markdown(study: dict) -> str:
    """The scripted-drafter study: per cache and drafter accuracy, speedup against its ceiling and
    the loop's own cost per call."""
    env = study["environment"]
    lines = [
        f"{study['model']}, {study['dtype']}, {env['threads']} threads, {env['cpu']} ({env['cpu_capability']}); "
        f"k={study['k']}, {study['new_tokens']} new tokens; t(k)/t(1): "
        + ", ".join(f"{impl} {c[str(study['k'])] / c['1']:.2f}" for impl, c in _str_keys(study["cost"]).items()),
        "",
        "| method | speedup | mean block | ceiling | efficiency | loop ms/call | forward share | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in study["methods"].items():
        ceiling = f"{r['ceiling']:.2f}x" if "ceiling" in r else "-"
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        block = f"{r['mean_block_size']:.2f}" if "mean_block_size" in r else "-"
        lines.append(
            f"| {name} | {r['speedup']:.2f}x | {block} | {ceiling} | {eff} | {r['overhead_ms_per_call']:.2f} | "
            f"{r['forward_share']:.2f} | {'yes' if r['identical_to_greedy'] else 'NO'} |"
        )
    return "\n".join(lines)


def _str_keys(cost: dict) -> dict:
    """Cost curves keyed by str(q), whether they come from memory (int keys) or from JSON."""
    return {impl: {str(q): t for q, t in c.items()} for impl, c in cost.items()}
