#!/usr/bin/env python
"""Where blockdecode wins on a CPU (issue 39): Llama models of growing size, against `transformers`' greedy
and llama.cpp's.

Each size is a Llama built from a config with random weights, in bf16 where the CPU computes it natively:
random weights give meaningless text but honest timing, as a call costs the same whatever its weights say.
For each size, in one process, side by side:

- the cost curve, t(q) / t(1) for a forward of q new tokens over a cached prompt, q up to 32;
- `transformers`' greedy `generate`, the baseline;
- llama.cpp's greedy on the same token ids (a GGUF written here with the `gguf` package, bf16), where
  `llama_cpp` is importable; its rows say "not installed" otherwise;
- blockdecode with `ScriptedDrafter`s whose accuracy at each depth is what the built-in model's heads and
  n-gram lookup reach on its held-out code (measured here first, and written to the JSON): the heads' chain,
  and the two in one tree.

Every figure goes to --out (JSON), with a plot of the speedups against model size beside it.

    python benchmarks/sizes.py                          # 10M .. 1B, about 15 minutes on 2 cores
    python benchmarks/sizes.py --sizes 10M,50M --new-tokens 32
    python benchmarks/sizes.py --device cuda --sizes 1B,8B --embed-scale 120   # on a GPU; 8B ties at 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from common import dtype_flag, heading, title  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from blockdecode import DEFAULT_MODEL, BlockwiseLM, ScriptedDrafter  # noqa: E402
from blockdecode.bench.methods import Method, Run, blockwise_run, measure, transformers_run  # noqa: E402
from blockdecode.core.hf import dtype_for  # noqa: E402
from blockdecode.core.io import read_prompts, save_figure, write_json  # noqa: E402
from blockdecode.decoding.loop import decode_prompts  # noqa: E402
from blockdecode.decoding.plan import make_plan  # noqa: E402
from blockdecode.decoding.reference import greedy_generate, near_tie  # noqa: E402
from blockdecode.decoding.timing import forward_cost  # noqa: E402
from blockdecode.drafters.ngram import NgramDrafter  # noqa: E402
from blockdecode.loading import load_tokenizer  # noqa: E402

# Llama shapes from the built-in model's up to about 1B parameters (Llama-3.2-1B's, with a 32k vocabulary),
# and Llama-3.1-8B's, for a GPU (not in the default sweep). Tiny ones for tests are given as "tiny:<hidden>x<layers>".
SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
SIZES: dict[str, dict] = {
    "10M": dict(zip(SHAPE, (384, 4, 6, 1024, 8192))),
    "50M": dict(zip(SHAPE, (512, 8, 8, 1536, 16384))),
    "150M": dict(zip(SHAPE, (768, 12, 12, 2048, 32000))),
    "400M": dict(zip(SHAPE, (1024, 24, 16, 2816, 32000))),
    "1B": dict(zip(SHAPE, (2048, 16, 32, 8192, 32000)), num_key_value_heads=8),
    "8B": dict(zip(SHAPE, (4096, 32, 32, 14336, 128256)), num_key_value_heads=8),  # Llama-3.1-8B's: for a GPU
}
COST_QS = (1, 2, 4, 8, 16, 32)
EMBED_SCALE = 30.0  # the embeddings' size against the layers' random outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        default=",".join(s for s in SIZES if s != "8B"),
        help=f"comma-separated: {', '.join(SIZES)}, or tiny:HxL",
    )
    p.add_argument("--out", default="benchmarks/results/sizes.json")
    p.add_argument("--k", type=int, default=8, help="block size of the scripted drafters")
    p.add_argument("--tree", type=int, default=16, help="node budget of the two drafters' tree")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    dtype_flag(p)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the models and every engine but llama.cpp there")
    p.add_argument(
        "--embed-scale",
        type=float,
        default=EMBED_SCALE,
        help="how much the embeddings are scaled, so greedy's argmax wins by a wide margin (a deep, wide model "
        "needs more: check the near ties each row reports)",
    )
    p.add_argument("--profile-prompts", type=int, default=8, help="held-out prompts the drafters' accuracy is read on")
    p.add_argument("--profile-tokens", type=int, default=128, help="tokens decoded on each of them")
    args = p.parse_args(argv)
    positive = ("k", "tree", "new_tokens", "prompt_len", "prompts", "repeats", "threads", "profile_prompts")
    for name in (*positive, "profile_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.k < 2:
        p.error(f"--k must be at least 2, got {args.k}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch has no CUDA device")
    for size in args.sizes.split(","):
        if size not in SIZES and not _tiny(size):
            p.error(f"unknown size {size!r}: choose {', '.join(SIZES)}, or tiny:<hidden>x<layers>")
    return args


def _tiny(size: str) -> dict | None:
    """A test-sized shape, "tiny:<hidden>x<layers>": 4 heads, a 512-token vocabulary."""
    parts = size.removeprefix("tiny:").split("x") if size.startswith("tiny:") else []
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % 8:
        return None
    hidden, layers = map(int, parts)
    return dict(zip(SHAPE, (hidden, layers, 4, 2 * hidden, 512)))


def build(
    size: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu", embed_scale: float = EMBED_SCALE
) -> LlamaForCausalLM:
    """A Llama of this size with random weights (transformers' own initialisation, seeded), whose greedy
    text is a walk through a random permutation of the vocabulary: the embeddings are scaled so the
    newest token's dominates the residual stream, and the output projection's row for token i is the
    embedding of the token that i follows. A random model's logits are otherwise nearly flat, and bf16
    rounding would flip greedy's argmax between engines and between one-token and k-token calls; here
    the argmax wins by a wide margin, and every engine's output can be checked against greedy's. The
    compute, and so the timing, is a Llama's of this shape. Built on `device`: an 8B model's initialisation
    would take minutes on a CPU."""
    shape = SIZES.get(size) or _tiny(size)
    config = LlamaConfig(**shape, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.mul_(embed_scale)
        order = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))
        model.lm_head.weight.copy_(embed[order.to(embed.device)])
    return model.to(dtype).eval()


@torch.inference_mode()
def near_tie_share(model: LlamaForCausalLM, references: list[torch.LongTensor], prompt_len: int) -> float:
    """The share of greedy's steps whose top-2 logit gap is within the dtype's rounding (`reference.near_tie`):
    where a k-token call may break the tie otherwise than a one-token call, and a drafter copying the one-token
    reference stops standing. The sweep's models should have none (a deeper, wider one needs a larger scale)."""
    ties = steps = 0
    for ref in references:
        top = model(ref).logits[0, prompt_len - 1 : -1].float().topk(2, dim=-1).values
        ties += sum(near_tie(float(a - b), float(a), model.dtype) for a, b in top.tolist())
        steps += top.shape[0]
    return ties / steps


def drafter_profiles(k: int, n_prompts: int, new_tokens: int = 128) -> dict[str, list[float]]:
    """Each drafter's accuracy at depths 1..k-1 given the depths before it stood, measured as its chain
    (exact, k) on the built-in model's held-out code prompts: what the scripted drafters reproduce."""
    lm = BlockwiseLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    texts = read_prompts(Path(DEFAULT_MODEL) / "prompts.json")[:n_prompts]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    profiles = {}
    for name, drafter in (("heads", lm.drafter()), ("ngram", NgramDrafter())):
        plan = make_plan(lm.base, drafter, k, eos_token_id=[], lm=lm)
        _, stats = decode_prompts(lm.base, prompts, new_tokens, plan)
        reached = [0] * k  # calls that accepted at least d proposals, and that proposed at least d
        tried = [0] * k
        for block, verified in zip(stats.block_sizes, stats.verified):
            for d in range(1, verified):
                tried[d] += 1
                reached[d] += block - 1 >= d
        rates = []
        for d in range(1, k):
            before = reached[d - 1] if d > 1 else tried[1]
            rates.append(reached[d] / before if before else 0.0)
        profiles[name] = [round(r, 4) for r in rates]
    return profiles


def write_gguf(model: LlamaForCausalLM, path: Path, bf16: bool) -> None:
    """The model as a llama.cpp GGUF, without a vocabulary (token ids in, token ids out): the `gguf`
    package's writer, the tensor names and the rotary permutation of llama.cpp's own converter."""
    import gguf
    import numpy as np

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("none")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # HF's rotate-half layout to llama.cpp's
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    parts = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            layer, part = name.removeprefix("model.layers.").split(".", 1)
            part, kind = part.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{parts[part]}.{kind}"
            if part == "self_attn.q_proj":
                tensor = permute(tensor, heads)
            elif part == "self_attn.k_proj":
                tensor = permute(tensor, kv_heads)
        else:
            gguf_name = names[name]
        data = tensor.float().numpy()
        if bf16 and data.ndim == 2:  # matrices in bf16, norms in f32 (as the converter writes them)
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)  # fmt: skip
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_greedy(path: Path, threads: int, context: int):
    """A run function: llama.cpp's greedy continuation of token ids, one token a call, as `transformers_run`."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    def run(ids: torch.LongTensor, new_tokens: int) -> Run:
        start = time.perf_counter()
        out = []
        for token in llm.generate(ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out.append(token)  # temp 0: llama.cpp's greedy sampler
            if len(out) == new_tokens:
                break
        return Run(out, time.perf_counter() - start, calls=new_tokens)

    return run


def llama_cpp_installed() -> bool:
    """Whether llama.cpp's bindings and the GGUF writer can be imported (`pip install .[llama]`)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "gguf"))


def measure_size(size: str, args: argparse.Namespace, dtype: torch.dtype, profiles: dict) -> dict:
    """Every figure of one size: parameters, cost curve, and each engine's tokens per second."""
    model = build(size, dtype, device=args.device, embed_scale=args.embed_scale)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, vocab, (1, args.prompt_len), generator=gen).to(args.device) for _ in range(args.prompts)
    ]
    cost = forward_cost(model, prompts[0], COST_QS, reps=3)
    n = args.new_tokens
    references = {
        tuple(p[0].tolist()): greedy_generate(model, p, n, eos_token_id=[], min_new_tokens=n) for p in prompts
    }

    def scripted(tree: bool):
        def run(ids: torch.LongTensor) -> Run:
            ref = references[tuple(ids[0].tolist())]
            drafters = [ScriptedDrafter(ref, vocab, profiles["heads"], seed=2)]
            if tree:
                drafters.insert(0, ScriptedDrafter(ref, vocab, profiles["ngram"], seed=3))
            plan = make_plan(model, drafters, args.k, args.tree if tree else None, eos_token_id=[])
            return blockwise_run(model, ids, n, plan)

        return run

    methods = [
        Method("transformers greedy", "greedy", lambda ids: transformers_run(model, ids, n)),
        Method(f"blockdecode heads chain k={args.k}", "heads", scripted(False), k=args.k),
        Method(f"blockdecode heads+ngram tree {args.tree} k={args.k}", "heads", scripted(True), k=args.k),
    ]
    llama = "measured" if llama_cpp_installed() and args.device == "cpu" else "not installed"
    with tempfile.TemporaryDirectory(prefix="sizes-") as folder:  # the GGUF, gone after its size
        if llama == "measured":
            path = Path(folder) / "model.gguf"
            write_gguf(model, path, dtype == torch.bfloat16)
            greedy = llama_cpp_greedy(path, args.threads, args.prompt_len + n + 8)
            methods.append(Method("llama.cpp greedy", "greedy", lambda ids: greedy(ids, n)))
        results = measure(methods, prompts, args.repeats, show=True)
    by = {m.name: results[m.name] for m in methods}
    row = {
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": {
            k: getattr(model.config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
            )
        },  # fmt: skip
        "cost_ratio": {q: cost[q] / cost[1] for q in COST_QS},
        "one_token_call_ms": 1000 * cost[1],
        "forward_ms": {q: 1000 * cost[q] for q in COST_QS},  # a bare forward of q tokens over the prompt
        # each engine's wall time per model call, loop included, beside the forward of as many tokens
        "ms_per_call": {name: 1000 * r["tokens_per_call"] / r["tokens_per_s"] for name, r in by.items()},
        "mean_verified": {name: r["mean_verified"] for name, r in by.items() if "mean_verified" in r},
        "llama_cpp": llama,
        "tokens_per_s": {name: r["tokens_per_s"] for name, r in by.items()},
        "speedup_over_transformers": {name: r["speedup"] for name, r in by.items()},
        "tokens_per_call": {name: r["tokens_per_call"] for name, r in by.items() if name != "transformers greedy"},
        "identical_to_greedy": {name: r["identical_to_greedy"] for name, r in by.items()},
        "greedy_near_tie_share": near_tie_share(model, list(references.values()), args.prompt_len),
    }
    if "llama.cpp greedy" in by:
        lc = by["llama.cpp greedy"]
        row["speedup_over_llama_cpp"] = {
            name: statistics.median(a / b for a, b in zip(r["speedup_per_round"], lc["speedup_per_round"]))
            for name, r in by.items()
        }  # within each round, t(llama.cpp) / t(method)
    return row


def plot(report: dict, png: Path) -> None:
    """Speedup against model size: blockdecode's best over transformers' greedy and over llama.cpp's, and
    llama.cpp's greedy over transformers'."""
    from blockdecode.core.plots import _pyplot

    plt = _pyplot()
    rows = report["sizes"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = [r["parameters"] / 1e6 for r in rows]
    best = [max(v for k, v in r["speedup_over_transformers"].items() if k.startswith("blockdecode")) for r in rows]
    ax.plot(sizes, best, "o-", label="blockdecode / transformers greedy")
    if all("speedup_over_llama_cpp" in r for r in rows):
        ours = [max(v for k, v in r["speedup_over_llama_cpp"].items() if k.startswith("blockdecode")) for r in rows]
        ax.plot(sizes, ours, "s-", label="blockdecode / llama.cpp greedy")
        theirs = [r["speedup_over_transformers"]["llama.cpp greedy"] for r in rows]
        ax.plot(sizes, theirs, "^-", label="llama.cpp greedy / transformers greedy")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("speedup")
    ax.legend()
    ax.set_title(f"Greedy decoding by model size\n{title(report)}", fontsize=9)
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dtype = dtype_for(args.dtype, args.device)
    profiles = drafter_profiles(args.k, args.profile_prompts, args.profile_tokens)
    print(f"drafters' accuracy by depth on held-out code: {profiles}")
    rows = [measure_size(size, args, dtype, profiles) for size in args.sizes.split(",")]
    report = {
        **heading("Llama by size, random weights", dtype, args.device, threads=args.threads, torch=torch.__version__),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "profiles": profiles,
        "note": "random weights: meaningless text, honest timing",
        "sizes": rows,
    }
    out = Path(args.out)
    write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print(title(report))
    for r in rows:
        print(f"{r['size']:>8} {r['parameters'] / 1e6:8.1f}M  t(8)/t(1) {r['cost_ratio'][8]:.2f}  "
              f"t(32)/t(1) {r['cost_ratio'][32]:.2f}  " + "  ".join(f"{k}: {v:.2f}x" for k, v in
                                                               r["speedup_over_transformers"].items()))  # fmt: skip
    return report


if __name__ == "__main__":
    main()
