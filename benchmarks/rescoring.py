"""What Kim et al. (2024) rescoring adds to the heads: tokens gained per call with the heads'
own proposals and with their top-8 lattice ranked by an n-gram model of the context, as a chain
at each k and as a tree, on code from installed third-party packages; and what a proposal costs.

Decoding is exact and fp32, so both drafters produce the same tokens and differ only in how many
calls they take. The proposal costs are timed side by side on one hidden state, as medians.

    python benchmarks/rescoring.py [--model DIR] [--prompts 12] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from paper_table import THIRD_PARTY, third_party_prompts
from tqdm.auto import tqdm

from blockdecode.bench.report import cpu_name
from blockdecode.builtin import DEFAULT_MODEL
from blockdecode.core.io import save_figure, write_json
from blockdecode.decoding.loop import decode_prompts
from blockdecode.model import load

OUT = Path(__file__).parent / "results" / "rescoring"
POWERS = (0.0, 0.5, 1.0)  # 0: the heads alone


def proposal_ms(drafter, tokens: torch.LongTensor, hidden: torch.Tensor, n: int, reps: int = 30) -> float:
    samples = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        drafter.propose(tokens, hidden, n)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:]) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="4,8,10")
    parser.add_argument("--tree", type=int, default=16)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    lm, tokenizer = load(args.model, torch.float32)
    prompts = third_party_prompts(tokenizer, THIRD_PARTY, args.prompts, args.prompt_len)
    ks = [k for k in map(int, args.ks.split(",")) if k <= lm.k]
    settings = [(k, None) for k in ks] + [(lm.k, args.tree)]
    rows, reference = [], {}
    for power in tqdm(POWERS, desc="rescoring power"):
        drafter = lm.drafter(rescore=power)
        for k, tree in settings:
            plan = lm.plan(drafter, k, tree=tree, eos_token_id=[])
            outs, stats = decode_prompts(lm.base, prompts, args.new_tokens, plan)
            sequences = [o.sequences[0].tolist() for o in outs]
            same = reference.setdefault((k, tree), sequences) == sequences
            rows.append({"power": power, "k": k, "tree": tree, "tokens_per_call": stats.mean_block_size,
                         "calls": len(stats.block_sizes), "identical_output": same})  # fmt: skip
    hidden = lm.base(prompts[0], output_hidden_states=True).hidden_states[-1][:, -1]
    cost = {str(p): proposal_ms(lm.drafter(rescore=p), prompts[0], hidden, lm.k - 1) for p in POWERS}
    report = {"model": str(args.model), "cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": "fp32",
              "prompts": len(prompts), "new_tokens": args.new_tokens, "rows": rows, "proposal_ms": cost}  # fmt: skip
    out = Path(args.out)
    write_json(out / "rescoring.json", report)
    plot(rows, settings, out / "rescoring.png")
    print("| setting | " + " | ".join(f"power {p:g}" for p in POWERS) + " |")
    print("|---|" + "---|" * len(POWERS))
    for k, tree in settings:
        cells = [r for r in rows if (r["k"], r["tree"]) == (k, tree)]
        name = f"k={k}" + (f", tree {tree}" if tree else "")
        print(f"| {name} | " + " | ".join(f"{r['tokens_per_call']:.2f}" for r in cells) + " |")
    print(f"| proposal ms (k-1={lm.k - 1} heads) | " + " | ".join(f"{cost[str(p)]:.2f}" for p in POWERS) + " |")


def plot(rows: list[dict], settings: list[tuple[int, int | None]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(POWERS)
    for i, power in enumerate(POWERS):
        values = [next(r["tokens_per_call"] for r in rows if (r["power"], r["k"], r["tree"]) == (power, k, t))
                  for k, t in settings]  # fmt: skip
        ax.bar([j + i * width for j in range(len(settings))], values, width, label=f"n-gram power {power:g}")
    ax.set_xticks([j + width for j in range(len(settings))])
    ax.set_xticklabels([f"k={k}" + (f"\ntree {t}" if t else "") for k, t in settings])
    ax.set_ylabel("tokens per call")
    ax.set_title("heads' proposals, rescored by an n-gram model of the context")
    ax.legend()
    save_figure(fig, png)


if __name__ == "__main__":
    main()
