#!/usr/bin/env python
"""Heads that read several layers against heads that read the final decoder output only, at equal
steps: issue 37 item 3, whether an EAGLE-3-style fusion of low, middle and high features pays for the
shipped paper heads.

1. Data: the mask pilot's rows (benchmarks/mask_pilot.py `distilled`: the built-in model's greedy
   continuations of training prompts, and of held-out prompts), found in --pilot's distill cache.
2. Features: one pass of the frozen base over the rows keeps the final decoder output h (the input of
   lm_head) and the outputs of the --layers, each put through the base's own final norm (the residual
   stream grows with depth: RMS 4.6 and 5.6 after layers 1 and 2 of the built-in model on held-out
   rows, a few entries past 50, h's 2.2; the norm puts every layer on h's scale, so one learning rate
   serves W and the heads). Training rows under bf16 autocast where the CPU computes bf16 natively
   (kept in bf16), held-out rows in fp32, as the pilot scores them.
3. Two arms, trained in lockstep on the same batches, the same seed, steps and schedule, the heads'
   loss of `blockdecode.training.objective` (each head's per-token cross-entropy over the draft vocabulary,
   averaged over heads 2..k):
     final: `PaperHeads` on h, as shipped;
     fused: the same heads (the same initial weights) reading h + W·[norm(low); norm(mid)], W zero at
            the start, so the arm starts as `final`; the heads' residual stays on h.
4. Held-out, every --eval-every steps, on every anchor of the pilot's held-out rows: per offset d = 2..k
   the share of greedy's tokens guessed and the chain's mean accepted block (mask_pilot's `scores`).
5. What a proposal costs: the median of timed drafting calls on one [1, D] state (heads, the draft
   vocabulary's projection, argmax; for `fused` also the norms and W), fp32 and bf16, one thread.

Writes layer_heads.json and layer_heads.png into --out.

    python benchmarks/layer_heads.py --out runs/layer_heads --pilot runs/mask_pilot --steps 1200
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode import DEFAULT_MODEL, load  # noqa: E402
from blockdecode.bench.report import cpu_name  # noqa: E402
from blockdecode.core.hf import vocab_size  # noqa: E402
from blockdecode.core.io import save_figure, saving_folder, write_json  # noqa: E402
from blockdecode.core.loss import IGNORE, draft_projection, head_targets, linear_cross_entropy  # noqa: E402
from blockdecode.drafters.heads import HeadsConfig, PaperHeads, most_frequent, short_projection  # noqa: E402
from blockdecode.drafters.masks import anchor_targets  # noqa: E402
from blockdecode.pretraining.pretrain import CorpusConfig, prepare_corpus  # noqa: E402
from blockdecode.training import loop as training
from blockdecode.training.data import batch_indices
from blockdecode.training.train import TrainConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the pilot's data and scores, as when run from anywhere
from mask_pilot import distilled, scores  # noqa: E402

REPORT = "layer_heads.json"
ARMS = ("final", "fused")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the report")
    p.add_argument("--pilot", help="a mask_pilot.py --out whose corpus/ and distill-cache/ hold the rows "
                   "(default: --out; what is missing is made there the pilot's way)")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="the frozen base (a saved BlockwiseLM or a model folder)")
    p.add_argument("--layers", default="1,2", help="layers fused beside h: 0 the embeddings, i layer i's output")
    p.add_argument("--steps", type=int, default=1200, help="training steps of each arm")
    p.add_argument("--k", type=int, default=8, help="the block: heads 2..k")
    p.add_argument("--head-hidden", type=int, default=128, help="the paper heads' hidden width per head")
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps, then cosine to a tenth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "no"), help="autocast of training")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--train-rows", type=int, default=4096, help="distilled training rows")
    p.add_argument("--eval-rows", type=int, default=64, help="distilled held-out rows")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    p.add_argument("--max-files", type=int, help="only the first N stdlib files in a new corpus (tiny trial runs)")
    p.add_argument("--cost-reps", type=int, default=200, help="timed drafting calls of each arm and dtype")
    p.add_argument("--loss-chunk", type=int, default=2048, help="rows of head logits held at once (memory only)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    counts = ("steps", "k", "head_hidden", "draft_vocab", "batch_size", "warmup", "prompt_len", "new_tokens",
              "train_rows", "eval_rows", "eval_every", "max_files", "cost_reps", "loss_chunk", "threads")  # fmt: skip
    for name in counts:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if not 0 < args.lr < math.inf:
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    try:
        args.layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
        p.error(f"--layers must be layer numbers separated by commas, e.g. 1,2, got {args.layers!r}")
    if len(set(args.layers)) != len(args.layers) or min(args.layers) < 0:
        p.error(f"--layers must be distinct layer numbers >= 0, got {','.join(map(str, args.layers))}")
    if args.k < 2 or args.new_tokens <= args.k:
        p.error(f"--k must be >= 2, and --new-tokens more than k for a block to fit, got {args.k}, {args.new_tokens}")
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model} is not a folder")
    return args


class LayerHeads(nn.Module):
    """Paper heads whose input is h, plus `fuse` of the other layers' outputs where there are some;
    their residual is h itself, so the states reach the base's own projection as the shipped heads' do.
    `fuse` starts at zero: the heads start as those on h alone."""

    def __init__(self, heads: PaperHeads, extra: int):
        super().__init__()
        self.heads = heads
        self.fuse = nn.Linear(extra, heads.d, bias=False) if extra else None
        if self.fuse is not None:
            nn.init.zeros_(self.fuse.weight)

    def forward(self, h: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., D], extra [..., E] (the layers' normed outputs side by side) -> states [..., k-1, D]."""
        x = h if self.fuse is None else h + self.fuse(extra)
        delta = self.heads.down(torch.relu(self.heads.up(x))).unflatten(-1, (self.heads.n, self.heads.d))
        return h.unsqueeze(-2) + delta


@dataclass
class Features:
    """Per row and position: the final decoder output h [N, T, D] and the --layers' normed outputs
    side by side [N, T, len(layers)·D]."""

    h: torch.Tensor
    extra: torch.Tensor


@torch.inference_mode()
def features(base, rows: torch.LongTensor, layers: list[int], precision: training.Precision, dtype: torch.dtype,
             chunk: int = 16, desc: str = "features") -> Features:  # fmt: skip
    """One pass of the frozen base over `rows` (padding -1 read as id 0: causal, it changes nothing
    before it), kept in `dtype`."""
    norm = final_norm(base)
    n, length = rows.shape
    width = base.get_output_embeddings().weight.shape[1]
    h = torch.empty(n, length, width, dtype=dtype)
    extra = torch.empty(n, length, len(layers) * width, dtype=dtype)
    for start in tqdm(range(0, n, chunk), desc=desc, unit="batch", mininterval=10):
        with precision.autocast():
            states = base.base_model(input_ids=rows[start : start + chunk].clamp(min=0), output_hidden_states=True)
            h[start : start + chunk] = states.last_hidden_state
            extra[start : start + chunk] = torch.cat([norm(states.hidden_states[i]) for i in layers], dim=-1)
    return Features(h, extra)


def final_norm(base) -> nn.Module:
    """The base's norm before lm_head (Llama-like models: `model.norm`)."""
    norm = getattr(base.base_model, "norm", None)
    if not isinstance(norm, nn.Module):
        raise SystemExit(f"layer_heads.py: error: {type(base).__name__} has no final norm at model.norm to read")
    return norm


def heads_loss(model: LayerHeads, feats: Features, idx: torch.LongTensor, labels: torch.LongTensor, project, short,
               chunk: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`blockdecode.training.objective`'s loss for heads 2..k on rows `idx`: the mean over heads of each head's
    per-token cross-entropy (targets outside the draft vocabulary counted, never learnt); and the
    per-head hit rate."""
    states = model(feats.h[idx], feats.extra[idx] if model.fuse is not None else None).unbind(-2)
    losses, rates = [], []
    for i in range(2, len(states) + 2):
        target = labels[:, : -(i - 1), i - 1]
        loss, hits = linear_cross_entropy(states[i - 2][:, : -(i - 1)], project, short(target), chunk)
        count = (target != IGNORE).sum().clamp(min=1)
        losses.append(loss / count)
        rates.append(hits / count)
    return torch.stack(losses).mean(), torch.stack(rates)


@torch.inference_mode()
def guesses(model: LayerHeads, feats: Features, rows: torch.LongTensor, k: int, prompt_len: int, projection,
            token_map: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:  # fmt: skip
    """The heads' chains [B, G, k-1] at every anchor of the held-out `rows` (each head's argmax over the
    draft vocabulary, as `HeadsDrafter` proposes), and greedy's tokens there (`anchor_targets`)."""
    anchors, targets = anchor_targets(rows, k, prompt_len)
    states = model(feats.h[:, anchors], feats.extra[:, anchors] if model.fuse is not None else None)
    return token_map[projection(states).argmax(-1)], targets


@torch.inference_mode()
def proposal_cost(arms: dict[str, LayerHeads], projection: nn.Linear, token_map, norm, layers: int, reps: int) -> dict:
    """Median milliseconds of one drafting call per arm and dtype on one [1, D] state: for `fused` the
    layers' norms, W and the heads, for `final` the heads; then the draft vocabulary's projection and
    the argmax. The calls take turns in every round, so drift on a shared machine spreads over all."""
    gen = torch.Generator().manual_seed(0)
    width = projection.weight.shape[1]
    calls = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        h = torch.randn(1, width, generator=gen).to(dtype)
        lows = [torch.randn(1, width, generator=gen).mul(5).to(dtype) for _ in range(layers)]
        project, lnorm = copy.deepcopy(projection).to(dtype), copy.deepcopy(norm).to(dtype)
        for arm, model in arms.items():
            model = copy.deepcopy(model).to(dtype)

            def call(model=model, h=h, lows=lows, project=project, lnorm=lnorm):
                extra = torch.cat([lnorm(x) for x in lows], dim=-1) if model.fuse is not None else None
                return token_map[project(model(h, extra)).argmax(-1)]

            calls[f"{arm} {name}"] = call
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 1):  # the first round warms up
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            calls[name]()
            if rep:
                samples[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(s) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    began, began_cpu = time.perf_counter(), time.process_time()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    out, pilot = Path(args.out), Path(args.pilot or args.out)
    lm, _ = load(args.model)
    base = lm.base.requires_grad_(False)
    depth, vocab = base.config.num_hidden_layers, vocab_size(base)
    if max(args.layers) >= depth:
        raise SystemExit(f"layer_heads.py: error: --layers must lie in 0..{depth - 1} (the base has {depth} layers: "
                         f"its last one's output is h), got {','.join(map(str, args.layers))}")  # fmt: skip
    if args.draft_vocab > vocab:
        raise SystemExit(f"layer_heads.py: error: --draft-vocab {args.draft_vocab} exceeds the vocabulary of {vocab}")
    corpus = pilot / "corpus"
    print(f"rows: {corpus}, {pilot / 'distill-cache'}", flush=True)
    prepare_corpus(CorpusConfig(out=str(corpus), tokenizer=args.model, packages=(), max_files=args.max_files))
    cfg = TrainConfig(
        base=args.model,
        data=[str(corpus / "train.npy")],
        out=str(out),
        k=args.k,
        mode="distill",
        seq_len=args.prompt_len + args.new_tokens,
        distill_prompts=args.train_rows,
        distill_prompt_len=args.prompt_len,
        distill_new_tokens=args.new_tokens,
        distill_cache=str(pilot / "distill-cache"),
    )
    rows, heldout = distilled(base, cfg, corpus, args.eval_rows)
    token_map, coverage = most_frequent(rows[:, args.prompt_len :], vocab, args.draft_vocab)

    precision = training.Precision(args.precision, base.device)
    store = torch.bfloat16 if precision.mode == "bf16" else torch.float32
    start = time.perf_counter()
    train_feats = features(base, rows, args.layers, precision, store, desc="features of the training rows")
    held_feats = features(base, heldout, args.layers, training.Precision("no", base.device), torch.float32,
                          desc="features of the held-out rows")  # fmt: skip
    feature_s = time.perf_counter() - start
    print(f"features: {len(rows)} + {len(heldout)} rows in {feature_s:.0f} s ({dtype_name(store)} kept)", flush=True)

    width = base.get_output_embeddings().weight.shape[1]
    heads_cfg = HeadsConfig(k=args.k, hidden_size=width, head_hidden_size=args.head_hidden, vocab_size=vocab,
                            draft_vocab=args.draft_vocab)  # fmt: skip
    torch.manual_seed(args.seed)
    shipped = PaperHeads(heads_cfg)
    arms = {"final": LayerHeads(shipped, 0), "fused": LayerHeads(copy.deepcopy(shipped), len(args.layers) * width)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for name, m in arms.items()}
    schedulers = {name: training.scheduler(o, args.warmup, args.steps, floor=0.1) for name, o in optimizers.items()}
    project, short = draft_projection(base.get_output_embeddings(), token_map)
    projection = short_projection(base.get_output_embeddings(), token_map)
    labels = head_targets(rows, args.k)  # [N, T, k]: head i's target at t is rows[t + i]

    cpu = dict.fromkeys(ARMS, 0.0)
    window = {name: [] for name in ARMS}
    curves: dict[str, list[dict]] = {name: [] for name in ARMS}
    anchors: list[int] = []  # held-out anchors scored (the same for every evaluation)

    def evaluate(step: int) -> None:
        line = [f"step {step:5d}"]
        for name, model in arms.items():
            found = scores(*guesses(model, held_feats, heldout, args.k, args.prompt_len, projection, token_map))
            anchors[:] = [found["anchors"]]
            losses = window[name]
            curves[name].append({
                "step": step,
                "cpu_s": round(cpu[name], 3),
                "train_loss": statistics.mean(losses) if losses else None,
                "block": found["mean_block"],
                "accuracy": found["accuracy"],
            })  # fmt: skip
            losses.clear()
            line.append(f"{name} block {found['mean_block']:.3f} (d=2 {found['accuracy']['2']:.3f}, "
                        f"{cpu[name]:.0f} CPU s)")  # fmt: skip
        print(", ".join(line), flush=True)

    evaluate(0)
    for step in range(args.steps):
        idx = batch_indices(step, len(rows), args.batch_size, args.seed)
        batch_labels = labels[idx]
        for name, model in arms.items():
            started = time.process_time()
            with precision.autocast():
                loss, _ = heads_loss(model, train_feats, idx, batch_labels, project, short, args.loss_chunk)
            loss.backward()
            optimizers[name].step()
            schedulers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            cpu[name] += time.process_time() - started
            window[name].append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)

    print("proposal cost: timed drafting calls", flush=True)
    cost = proposal_cost(arms, projection, token_map, final_norm(base), len(args.layers), args.cost_reps)
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in arms.items()}
    report = {
        "config": vars(args),
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "precision": precision.mode,
            "torch": torch.__version__,
        },  # fmt: skip
        "data": {
            "train_rows": len(rows),
            "heldout_rows": len(heldout),
            "row_tokens": rows.shape[1],
            "heldout_anchors": anchors[0],
            "draft_vocab_coverage": coverage,
            "features_s": feature_s,
            "features_dtype": dtype_name(store),
        },  # fmt: skip
        "arms": {
            name: {
                "params": params[name],
                "params_added": params[name] - params["final"],
                "steps": args.steps,
                "train_cpu_s": cpu[name],
                "cpu_s_per_step": cpu[name] / args.steps,
                "proposal_ms": {dtype: ms for key, ms in cost.items() for a, dtype in [key.split()] if a == name},
                "heldout": {"mean_block": curves[name][-1]["block"], "accuracy": curves[name][-1]["accuracy"]},
                "curve": curves[name],
            }
            for name in ARMS
        },
        "wall_s": time.perf_counter() - began,
        "cpu_s": time.process_time() - began_cpu,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    write_report(report, out)
    print(summary(report), flush=True)
    return report


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def write_report(report: dict, out: Path) -> None:
    """layer_heads.png and layer_heads.json (last), replacing an earlier report as a whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, layers = report["config"]["k"], report["config"]["layers"]
    labels = {"final": "final: heads on h", "fused": f"fused: h + W·[layers {','.join(map(str, layers))}]"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, arm in report["arms"].items():
        curve = arm["curve"]
        left.plot([r["step"] for r in curve], [r["block"] for r in curve], "o-", markersize=3, label=labels[name])
    left.set_xlabel("training steps (the same batches for both)")
    left.set_ylabel(f"held-out mean accepted block at k={k}")
    left.legend(fontsize="small")
    offsets = [int(d) for d in report["arms"]["final"]["heldout"]["accuracy"]]
    bar = 0.4
    for i, (name, arm) in enumerate(report["arms"].items()):
        found = arm["heldout"]
        right.bar([d + (i - 0.5) * bar for d in offsets], list(found["accuracy"].values()), bar,
                  label=f"{labels[name]} (block {found['mean_block']:.3f})")  # fmt: skip
    right.set_xticks(offsets)
    right.set_xlabel(f"offset d (token t+d guessed at t), after {report['config']['steps']} steps")
    right.set_ylabel("held-out share of greedy's tokens guessed")
    right.legend(fontsize="small")
    with saving_folder(out, REPORT) as staging:
        save_figure(fig, staging / "layer_heads.png")
        write_json(staging / REPORT, report)


def summary(report: dict) -> str:
    arms = report["arms"]
    offsets = list(arms["final"]["heldout"]["accuracy"])
    lines = [f"{'':6} {'block':>6}  " + " ".join(f"d={d:<4}" for d in offsets) + "  params    ms/call fp32, bf16"]
    for name, arm in arms.items():
        found = arm["heldout"]
        lines.append(
            f"{name:6} {found['mean_block']:6.3f}  " + " ".join(f"{a:.3f}" for a in found["accuracy"].values())
            + f"  {arm['params']:>9,}  {arm['proposal_ms']['fp32']:.3f}, {arm['proposal_ms']['bf16']:.3f}"
        )  # fmt: skip
    lines.append(f"{report['config']['steps']} steps each; training CPU s per step: "
                 + ", ".join(f"{n} {a['cpu_s_per_step']:.3f}" for n, a in arms.items())
                 + f"; wall {report['wall_s'] / 60:.1f} min, CPU {report['cpu_s'] / 60:.1f} min")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
