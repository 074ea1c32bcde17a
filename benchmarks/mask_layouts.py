#!/usr/bin/env python
"""Where mask groups could go in a verify call, what each layout costs, and what it can gain: issue 37's
layout decision for the masks the pilot (`benchmarks/mask_pilot.py`) trained.

A mask group after node i of a call drafts the block that follows if the accepted path ends at i. So a
group after the last candidate alone drafts only after a whole chain stands; a group after every node
(k + k(k-1) = k^2 positions, each group seeing its node's ancestors and its own earlier masks) always
has the next block ready. For each k and layout this measures one verify call over a cached context
(the base's dtype, the masks' hooks attached, logits for the k real positions, the masks' states
through the draft vocabulary), against a one-token call, and the plain cost curve t(q)/t(1). With the
chains' mean accepted block on the pilot's held-out anchors (teacher-forced, as the pilot scores them)
it gives each layout's tokens per one-token call: block / cost. For the layout after the last
candidate that is a bound (it assumes a mask draft every call), so a layout that loses even so is out.

    python benchmarks/mask_layouts.py --pilot runs/mask_pilot
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import mask_pilot  # noqa: E402  (beside this script)
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode import DEFAULT_MODEL, load  # noqa: E402
from blockdecode.bench.report import cpu_name  # noqa: E402
from blockdecode.core.hardware import native_bf16  # noqa: E402
from blockdecode.core.hf import dtype_name  # noqa: E402
from blockdecode.core.io import load_npy, read_json, save_figure, write_json  # noqa: E402
from blockdecode.core.loss import IGNORE  # noqa: E402
from blockdecode.decoding.adapter import adapter_for  # noqa: E402
from blockdecode.drafters.heads import short_projection  # noqa: E402
from blockdecode.drafters.masks import MaskDrafts, attached, load_masks  # noqa: E402
from blockdecode.training.data import load_tokens, pack  # noqa: E402

REPORT = "mask_layouts.json"
CURVE = (1, 2, 4, 8, 16, 32, 64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pilot", required=True, help="the mask pilot's --out: its masks/, corpus/ and distilled rows")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the saved BlockwiseLM the pilot ran on")
    p.add_argument("--out", default="benchmarks/results", help="folder for mask_layouts.json and .png")
    p.add_argument("--ks", default="4,6,8", help="block sizes, comma-separated, each 2..the masks' k")
    p.add_argument("--reps", type=int, default=60, help="timed calls of each kind")
    p.add_argument("--context", type=int, default=256, help="tokens cached before the timed calls")
    p.add_argument("--heldout-rows", type=int, default=64, help="held-out distilled rows scored")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("reps", "context", "heldout_rows", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    try:
        args.ks = sorted({int(k) for k in args.ks.split(",")})
    except ValueError:
        p.error(f"--ks must be integers separated by commas, got {args.ks!r}")
    if not (Path(args.pilot) / "mask_pilot.json").is_file():
        p.error(f"{args.pilot} holds no mask_pilot.json: run benchmarks/mask_pilot.py --out {args.pilot} first")
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model} is not a folder")
    return args


def chain_blocks(guesses: torch.LongTensor, targets: torch.LongTensor, ks: list[int]) -> dict[str, float]:
    """The mean accepted block of the chains' first k-1 guesses, per k, over anchors whose whole block
    lies in the continuation: 1 + the guesses right before the first wrong one."""
    full = (targets != IGNORE).all(-1)
    hits = (guesses == targets)[full].long()
    return {str(k): float(1 + hits[:, : k - 1].cumprod(-1).sum(-1).float().mean()) for k in ks}


def layout(k: int, groups: list[int]) -> tuple[torch.LongTensor, torch.Tensor]:
    """Positions (offsets from the newest token) and the [q, q] attention of a chain of k real nodes
    with a group of k-1 masks after each node in `groups`: mask j of the group after node i sits at
    i + j, sees nodes 0..i and its group's masks up to itself."""
    n = k - 1
    q = k + n * len(groups)
    positions = torch.cat([torch.arange(k), *[i + torch.arange(1, k) for i in groups]]) if groups else torch.arange(k)
    allowed = torch.zeros(q, q, dtype=torch.bool)
    allowed[:k, :k] = torch.ones(k, k, dtype=torch.bool).tril()
    for g, i in enumerate(groups):
        rows = slice(k + g * n, k + (g + 1) * n)
        allowed[rows, : i + 1] = True
        allowed[rows, rows] = torch.ones(n, n, dtype=torch.bool).tril()
    return positions, allowed


@torch.inference_mode()
def call_costs(base, masks: MaskDrafts, context: torch.LongTensor, ks: list[int], reps: int) -> dict:
    """Median seconds of each kind of verify call over `context`, cached: plain q tokens (logits for all,
    as a tree of q nodes), and per k each layout (logits for the k real nodes, the masks' states through
    the draft vocabulary). Kinds take turns in every round; the hooks stay attached throughout, as a
    decode that drafts with masks holds them."""
    length, vocab = context.shape[1], masks.config.vocab_size
    adapter = adapter_for(base, None, "dynamic", length + max(CURVE) + max(ks) ** 2)
    adapter.prefill(context)
    project = short_projection(base.get_output_embeddings(), masks.token_map)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.LongTensor:
        return torch.randint(0, vocab, (1, n), generator=gen).to(context.device)

    kinds: dict[str, tuple] = {f"plain {q}": (tokens(q), None, None, 0) for q in CURVE}
    for k in ks:
        for name, groups in (("chain", []), ("group after the last", [k - 1]), ("groups after all", list(range(k)))):
            positions, allowed = layout(k, groups)
            ids = torch.cat([tokens(k), (vocab + torch.arange(k - 1)).repeat(len(groups))[None]], dim=1)
            kinds[f"k={k} {name}"] = (ids, positions + length, allowed if groups else None, k)

    def timed(ids: torch.LongTensor, positions, allowed, real: int):
        def call() -> float:
            start = time.perf_counter()
            if allowed is None:
                adapter.score(ids)
            else:
                mask = adapter._attention_mask(allowed[None])
                _, h = adapter._forward(ids, position_ids=positions[None], attention_mask=mask, logits_to_keep=0)
                project(h[:, real:]).argmax(-1)  # the masks' drafts, through the draft vocabulary
            elapsed = time.perf_counter() - start
            adapter.keep(range(length))
            return elapsed

        return call

    with attached(base, masks.to(base.device)):
        seconds = mask_pilot.medians_in_turns({name: timed(*kind) for name, kind in kinds.items()}, reps)
    return {
        "positions": {name: int(kinds[name][0].shape[1]) for name in kinds},
        "ms": {name: 1e3 * s for name, s in seconds.items()},
        "over_one_token": {name: s / seconds["plain 1"] for name, s in seconds.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)

    pilot = Path(args.pilot)
    lm, _ = load(args.model)
    base = lm.base.requires_grad_(False)
    masks = load_masks(pilot / "masks", base)
    ks = [k for k in args.ks if 2 <= k <= masks.config.k]
    if not ks:
        raise SystemExit(f"mask_layouts.py: error: --ks holds no k in 2..{masks.config.k}, the masks' block")
    heldout = held_out_rows(pilot, args.heldout_rows)
    prompt_len = read_json(pilot / mask_pilot.REPORT)["config"]["prompt_len"]
    print(f"held-out: {len(heldout)} rows, masks and heads", flush=True)
    blocks = {
        "masks": chain_blocks(*mask_pilot.mask_guesses(base, masks, heldout, prompt_len), ks),
        "shipped heads": chain_blocks(*mask_pilot.heads_guesses(lm, heldout, prompt_len, masks.config.k), ks),
    }
    print("verify calls", flush=True)
    lm16, _ = load(args.model, dtype=torch.bfloat16)
    corpus = pilot / "corpus" / "heldout.npy"
    context = pack(load_tokens([str(corpus)]), args.context)[:1]
    costs = call_costs(lm16.base, masks, context, ks, args.reps)
    cost = costs["over_one_token"]
    speed = {}
    for k in ks:
        speed[str(k)] = {
            "heads chain": blocks["shipped heads"][str(k)] / cost[f"k={k} chain"],
            "masks, group after the last (bound)": blocks["masks"][str(k)] / cost[f"k={k} group after the last"],
            "masks, groups after all": blocks["masks"][str(k)] / cost[f"k={k} groups after all"],
        }
    report = {
        "config": {k: v for k, v in vars(args).items()},
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "native_bf16": native_bf16()},
        "dtype": dtype_name(lm16.base.dtype),
        "blocks": blocks,
        "call_cost": costs,
        "tokens_per_one_token_call": speed,
    }
    write_report(report, Path(args.out))
    for k in ks:
        print(f"k={k}: " + ", ".join(f"{name} {v:.2f}" for name, v in speed[str(k)].items()), flush=True)
    return report


def held_out_rows(pilot: Path, rows: int) -> torch.LongTensor:
    """The pilot's held-out distilled rows: the smaller of its two distillation caches."""
    caches = sorted((pilot / "distill-cache").glob("distill-*.npy"), key=lambda p: p.stat().st_size)
    if not caches:
        raise SystemExit(f"mask_layouts.py: error: {pilot / 'distill-cache'} holds no distilled rows")
    return torch.from_numpy(load_npy(caches[0]).astype("int64"))[:rows]


def write_report(report: dict, out: Path) -> None:
    """mask_layouts.png (the cost curve; each layout's tokens per one-token call) and mask_layouts.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = report["call_cost"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(CURVE, [cost["over_one_token"][f"plain {q}"] for q in CURVE], "o-", label="plain q tokens")
    for name in ("chain", "group after the last", "groups after all"):
        keys = [key for key in cost["ms"] if key.startswith("k=") and key.endswith(name)]
        left.plot([cost["positions"][key] for key in keys], [cost["over_one_token"][key] for key in keys], "s",
                  label=f"{name} (k = {', '.join(key.split()[0][2:] for key in keys)})")  # fmt: skip
    left.set_xscale("log", base=2)
    left.set_xlabel("positions in the call")
    left.set_ylabel("cost / one-token call")
    left.legend(fontsize=8)
    speed = report["tokens_per_one_token_call"]
    ks = list(speed)
    for i, name in enumerate(speed[ks[0]]):
        right.bar([x + 0.27 * (i - 1) for x in range(len(ks))], [speed[k][name] for k in ks], 0.27, label=name)
    right.set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
    right.set_ylabel("tokens per one-token call (block / cost)")
    right.legend(fontsize=8)
    fig.suptitle(f"mask layouts, {report['dtype']}, {report['machine']['threads']} thread(s)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out / "mask_layouts.png")
    write_json(out / REPORT, report)


if __name__ == "__main__":
    main()
