"""The `blockdecode` command."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from blockdecode.builtin import DEFAULT_MODEL
from blockdecode.commands.flags import (
    DRAFTER_CHOICES,
    Parser,
    check_corpus,
    check_drafter,
    comma_names,
    config_from,
    is_text,
    listed,
    positive_int,
    random_seed,
    read_value_map,
    temperature,
    top_k,
    top_p,
    tree_budget,
    tree_budgets,
)
from blockdecode.core.hardware import MIXED_PRECISIONS
from blockdecode.core.hf import DTYPE_CHOICES, DTYPES, dtype_for, dtype_name, is_seq2seq
from blockdecode.core.io import check_writable
from blockdecode.drafters.heads import HEAD_TYPES
from blockdecode.loading import load_config, load_tokenizer
from blockdecode.pretraining.corpus import CORPUS_PACKAGES
from blockdecode.serving.export import EAGLE3_FORMATS, EXPORT_FORMATS

NO_HEAL = (
    "continue a prompt that ends mid-token (in a bare newline or space) from its last token as it is, "
    "not from its text (token healing, on by default; a translation is never healed)"
)


def cmd_generate(args: argparse.Namespace) -> None:
    from blockdecode.core.hf import vocab_size
    from blockdecode.decoding.acceptance import parse_acceptance
    from blockdecode.decoding.adapter import check_prompt
    from blockdecode.decoding.healing import heal_prompts
    from blockdecode.decoding.reference import first_divergence, greedy_generate
    from blockdecode.loading import has_heads, model_folder
    from blockdecode.model import load

    # Settings first: a bad rule or value map is reported before the model takes seconds to load.
    if args.value_map and not args.acceptance.startswith("distance"):
        raise ValueError(f"--value-map is for --acceptance distance:EPS, not {args.acceptance}")
    acceptance = parse_acceptance(args.acceptance, read_value_map(args.value_map) if args.value_map else None)
    warpers = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    given = [f"--{name.replace('_', '-')}" for name, v in {**warpers, "seed": args.seed}.items() if v is not None]
    if given and not args.sample:
        raise ValueError(f"{', '.join(given)} applies only when sampling: add --sample")
    if args.sample and args.compare:
        raise ValueError("--compare checks the output against greedy decoding; a sampled output is not greedy's")
    if args.sample and acceptance.rule != "exact":
        raise ValueError(f"--acceptance {args.acceptance} is approximate, which has no exact meaning with --sample")
    check_drafter(args.drafter, args.tree)
    check_corpus(args.drafter, args.corpus)

    dtype = dtype_for(args.dtype)
    model, tokenizer = load(args.model, dtype, args.k, args.head_type)
    if args.eagle3:
        model.attach_eagle3(args.eagle3)
    if not has_heads(model_folder(args.model)):
        print(
            f"note: {args.model} has no trained heads; using untrained {model.config.head_type} heads", file=sys.stderr
        )
    ids = check_prompt(model.base, tokenizer(args.prompt, return_tensors="pt").input_ids, args.max_new_tokens)
    seq2seq = is_seq2seq(model.base)  # the output is the decoder's: a translation, not a continuation
    heal = tokenizer if args.heal and not seq2seq else None
    healing = heal_prompts(heal, ids) if heal is not None else None
    if healing is not None and healing.healed:
        print(f"{healing.note()} (--no-heal: off)", file=sys.stderr)
    prompts = model.prompts or [ids]  # "auto" times on the model's own prompts
    with warnings.catch_warnings():  # a tree the plan cannot use is said once, as its note below
        warnings.simplefilter("ignore")
        plan = model.plan(
            args.drafter, args.k, args.tree, acceptance, prompts=prompts, do_sample=args.sample, **warpers
        )
    generator = torch.Generator(device=model.base.device)
    seed = generator.seed() if args.seed is None else args.seed  # a fresh one unless given, shown to repeat the run
    generator.manual_seed(seed)
    corpus = [Path(p) for p in args.corpus] if args.corpus else None
    out = model.generate(ids, args.max_new_tokens, plan=plan, generator=generator, heal=heal, corpus=corpus)
    print(tokenizer.decode(out.sequences[0], skip_special_tokens=seq2seq))
    s = out.stats
    print(
        f"\nblockwise ({plan.drafter_name}, k={plan.k}, {plan.setting}, {dtype_name(dtype)}): {s.new_tokens} tokens, "
        f"{s.calls} calls, mean accepted block {s.mean_block_size:.2f}, {s.tokens_per_second:.1f} tokens/s",
        file=sys.stderr,
    )
    if s.sampling:
        print(f"sampled ({s.sampling}, --seed {seed}): exact in distribution, not the greedy output", file=sys.stderr)
    elif not s.exact:
        print(f"acceptance {s.acceptance}: approximate, this is NOT the exact greedy output", file=sys.stderr)
    if s.note:
        print(f"note: {s.note}", file=sys.stderr)
    if args.compare:
        prompt = ids if healing is None else healing.input_ids  # healed: transformers with the same constraint
        constraint = None if healing is None else healing.prefix_allowed_tokens_fn(vocab_size(model.base))
        start = time.perf_counter()
        ref = greedy_generate(model.base, prompt, args.max_new_tokens, prefix_allowed_tokens_fn=constraint)
        seconds = time.perf_counter() - start
        new = ref.shape[1] - (1 if seq2seq else prompt.shape[1])
        print(f"greedy (transformers): {new} tokens, {new} calls, {new / seconds:.1f} tokens/s", file=sys.stderr)
        diverged = first_divergence(model.base, ref, out.sequences, source=ids if seq2seq else None)
        note = "" if s.exact else f"; expected under approximate acceptance {s.acceptance}"
        if diverged is None:
            verdict = "yes"
        elif diverged.near_tie(model.base.dtype):
            verdict = f"no, a near tie within {dtype_name(dtype)} rounding ({diverged}{note})"
        else:
            verdict = f"NO ({diverged}{note})"
        print(f"identical: {verdict}", file=sys.stderr)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt with exact blockwise decoding (greedy, or --sample)")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="saved BlockwiseLM or transformers causal-LM folder (default: built-in)"
    )
    p.add_argument("--prompt", required=True, help="the text to continue; - reads it from standard input")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--k", type=positive_int, default=None, help="block size (default: the heads' k)")
    p.add_argument(
        "--drafter", choices=DRAFTER_CHOICES, default="auto", help="where proposals come from (auto: measured)"
    )
    p.add_argument(
        "--tree",
        type=tree_budget,
        default="default",
        help="N candidates a call, expected (ranked; default, greedy), auto (measured; default, sampling), off",
    )
    p.add_argument(
        "--head-type", choices=HEAD_TYPES, default=None, help="for a model without trained heads (default: paper)"
    )
    p.add_argument(
        "--eagle3",
        default=None,
        help="an EAGLE-3 drafter for this model (a folder in the speculators or the original layout), for "
        "--drafter eagle3 (default: the one saved with the model, if any)",
    )
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bf16 where native, else fp32")
    p.add_argument("--compare", action="store_true", help="also run transformers greedy and compare outputs")
    p.add_argument(
        "--acceptance",
        default="exact",
        help="exact (default), or approximate: topk:N, distance:EPS (needs --value-map), min-block:L",
    )
    p.add_argument("--value-map", default=None, help="JSON list: each token id's value, for distance:EPS")
    p.add_argument(
        "--sample", action="store_true", help="sample as transformers' do_sample=True does, exactly in distribution"
    )
    p.add_argument(
        "--temperature", type=temperature, default=None, help="with --sample (default: the generation config's)"
    )
    p.add_argument(
        "--top-k", type=top_k, default=None, help="with --sample: 0 is off (default: the generation config's)"
    )
    p.add_argument(
        "--top-p", type=top_p, default=None, help="with --sample: 1 is off (default: the generation config's)"
    )
    p.add_argument("--seed", type=random_seed, default=None, help="with --sample: the same seed gives the same text")
    p.add_argument("--no-heal", dest="heal", action="store_false", help=NO_HEAL)
    add_corpus_flag(p)
    p.set_defaults(func=cmd_generate)


def add_corpus_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--corpus",
        action="append",
        metavar="PATH",
        help="with --drafter suffix or heads+suffix: a file or folder of text it also drafts from (repeatable; "
        "indexed once, cached in ~/.cache/blockdecode/corpus)",
    )


def cmd_train(args: argparse.Namespace) -> None:
    from blockdecode.training.train import TrainConfig, train, training_summary

    cfg = config_from(TrainConfig, args)
    model = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # once, not once per process under a launcher
        if cfg.head_type == "eagle3":
            layers = list(model.eagle3.config.aux_layers)
            print(f"saved an EAGLE-3 drafter (layers {layers}) with its model to {cfg.out}", file=sys.stderr)
        else:
            print(f"saved {model.config.head_type} heads (k={model.k}) to {cfg.out}", file=sys.stderr)
        print(training_summary(cfg.out), file=sys.stderr)


def add_train_parser(sub) -> None:
    from blockdecode.training.config import BASE_LOSS_ON, HEAD_LOSSES, MODES, TARGETS, TRAIN_HEAD_TYPES, TrainConfig
    from blockdecode.training.train import RESUME_MUST_MATCH

    d = TrainConfig(base="", data=["-"], out="")
    modes = "\n".join(f"  {name:17} {text}" for name, text in MODES.items())
    p = sub.add_parser(
        "train",
        help="train proposal heads",
        description=f"Train proposal heads. Modes:\n{modes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base", default=DEFAULT_MODEL, help="transformers causal-LM directory, with its tokenizer (default: built-in)"
    )
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files, folders of them, or .npy token-id arrays; for an encoder-decoder base, pairs: one .tsv "
        "(source and target in its last two columns) or two aligned text files",
    )
    p.add_argument("--out", required=True, help="where checkpoints, metrics.jsonl, training.png and the model go")
    p.add_argument("--k", type=int, default=d.k, help="block size: heads p2..pk are trained")
    p.add_argument("--mode", choices=tuple(MODES), default=d.mode)
    p.add_argument(
        "--head-type",
        choices=TRAIN_HEAD_TYPES,
        default=d.head_type,
        help="eagle3: an EAGLE-3 drafter (one layer reading three of the base's), for the serving engines too",
    )
    p.add_argument(
        "--aux-layers",
        type=int,
        nargs=3,
        default=None,
        help="eagle3: the layers whose inputs it reads, vLLM's ids (0: the embeddings; default 2, N/2, N-3, or "
        "three distinct layers of a shallow base)",
    )
    p.add_argument("--head-hidden-size", type=int, default=d.head_hidden_size, help="0: the base's hidden size")
    p.add_argument(
        "--draft-vocab", type=int, default=d.draft_vocab, help="N: the heads score only their N most frequent targets"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, split over processes")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate of the heads")
    p.add_argument("--base-lr", type=float, default=d.base_lr, help="learning rate of the base (finetune modes)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--head-loss", choices=HEAD_LOSSES, default=d.head_loss, help="random: one head per step")
    p.add_argument(
        "--targets", choices=tuple(TARGETS), default=d.targets, help="soft: the base's distribution, not its argmax"
    )
    p.add_argument("--head-weights", type=float, nargs="+", default=None, help="k-1 weights, heads 2..k (all)")
    p.add_argument("--base-loss-weight", type=float, default=d.base_loss_weight, help="finetune: base's own loss")
    p.add_argument(
        "--base-loss-on",
        choices=tuple(BASE_LOSS_ON),
        default=d.base_loss_on,
        help="finetune+distill: data measures the base's own loss on real rows, keeping its quality",
    )
    p.add_argument("--holdout", type=float, default=d.holdout, help="fraction of sequences held out")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts decoded per eval")
    p.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens, help="tokens decoded per eval prompt")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--resume", action="store_true", help=RESUME)
    p.add_argument("--seed", type=random_seed, default=d.seed)
    p.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=d.mixed_precision)
    p.add_argument(
        "--distill-prompts", type=int, default=d.distill_prompts, help="prompts (or source sentences) distilled"
    )
    p.add_argument("--distill-new-tokens", type=int, default=d.distill_new_tokens)
    p.add_argument("--distill-batch-size", type=int, default=d.distill_batch_size, help="rows generated at once")
    p.add_argument("--distill-beams", type=int, default=d.distill_beams, help="1: greedy; more: beam search")
    p.add_argument("--distill-cache", default=None, help="folder for distilled data, reused across runs")
    p.add_argument(
        "--distill-sources",
        nargs="+",
        default=None,
        metavar="FILE",
        help="encoder-decoder distill modes: text files of more source sentences, one a line (bible "
        "--extra-sources writes them); --distill-prompts are drawn evenly from the training sources and these",
    )
    p.add_argument(
        "--feature-cache",
        default=None,
        help="frozen/distill: a folder where the base's outputs on the training rows are computed once, reused",
    )
    p.add_argument("--patience", type=int, default=d.patience, help="stop after N evals with no longer block; 0: off")
    p.add_argument("--init-heads", default=None, help="a saved BlockwiseLM whose heads start this run")
    p.add_argument("--min-delta", type=float, default=d.min_delta, help="the block growth that counts (--patience)")
    p.add_argument(
        "--doubling-gain",
        type=float,
        default=d.doubling_gain,
        help="stop once the held-out block grows less than this over a doubling of steps (tokens); 0: off",
    )
    say_what_may_change(p, TrainConfig, RESUME_MUST_MATCH)
    p.set_defaults(func=cmd_train)


def cmd_pretrain(args: argparse.Namespace) -> None:
    from blockdecode.pretraining.pretrain import CorpusConfig, PretrainConfig, prepare_corpus, pretrain
    from blockdecode.training.loop import check_new_run

    # Every setting is checked, and --out found writable and free, before the corpus is read or written.
    cfg = config_from(PretrainConfig, args)
    corpus = config_from(CorpusConfig, args, out=args.corpus)
    check_writable(Path(args.out))
    check_new_run(cfg.out, cfg.resume)
    prepare_corpus(corpus)
    pretrain(cfg)
    print(f"saved the base model and its tokenizer to {Path(cfg.out) / 'model'}", file=sys.stderr)


def add_pretrain_parser(sub) -> None:
    from blockdecode.pretraining.pretrain import RESUME_MUST_MATCH, PretrainConfig

    d = PretrainConfig(corpus="", out="")
    p = sub.add_parser(
        "pretrain",
        help="train a base model from scratch on Python source: the standard library's, torch's, transformers'",
        description="Prepare the corpus (split by file, BPE tokenizer trained on the training files) unless "
        "--corpus already holds it, then train a Llama on it. --resume continues a stopped run.",
    )
    p.add_argument("--corpus", required=True, help="folder for tokenizer.json and {train,heldout}.npy (reused)")
    p.add_argument("--out", required=True, help="checkpoints, metrics.jsonl, pretrain.png and model/ go here")
    p.add_argument("--root", default=None, help="a folder of .py files instead of the standard library")
    p.add_argument(
        "--packages", nargs="*", default=list(CORPUS_PACKAGES), help="installed packages whose source joins the corpus"
    )
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (quick trials)")
    ints = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "context", "steps", "batch_size")
    ints += ("seq_len", "warmup_steps", "eval_every", "eval_batches", "checkpoint_every")
    add_run_arguments(p, d, ints, ("lr", "min_lr", "weight_decay"))
    p.add_argument("--no-compile", dest="compile", action="store_false", help="train without torch.compile")
    say_what_may_change(p, PretrainConfig, RESUME_MUST_MATCH)
    p.set_defaults(func=cmd_pretrain)


def add_run_arguments(p, defaults, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    """--flags for a from-scratch run's config fields, defaulting to the dataclass's values; then
    --seed, --mixed-precision and --resume."""
    for names, kind in ((ints, int), (floats, float)):
        for name in names:
            p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name))
    p.add_argument("--seed", type=random_seed, default=defaults.seed)
    p.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=defaults.mixed_precision)
    p.add_argument("--resume", action="store_true", help=RESUME)


RESUME = "continue from the checkpoint in --out, refused if a setting that decides what is trained differs"


def say_what_may_change(p: argparse.ArgumentParser, config: type, must_match: tuple[str, ...]) -> None:
    """Each flag of a run's setting that a resume does not check says in its help that it may change
    (`must_match`: those it checks; the data's or corpus' content is checked by its fingerprint)."""
    fixed = (*must_match, "data", "corpus", "out", "resume")
    for action in p._actions:
        if action.dest in config.__dataclass_fields__ and action.dest not in fixed:
            action.help = f"{action.help or ''} (may change on --resume)".lstrip()


def cmd_pretrain_translation(args: argparse.Namespace) -> None:
    from blockdecode.pretraining.translation import TranslationConfig, train_translation

    cfg = config_from(TranslationConfig, args)
    train_translation(cfg)
    print(f"saved the translation model and its tokenizer to {Path(cfg.out) / 'model'}", file=sys.stderr)


def add_pretrain_translation_parser(sub) -> None:
    from blockdecode.pretraining.translation import RESUME_MUST_MATCH, TranslationConfig

    d = TranslationConfig(corpus="", out="")
    p = sub.add_parser(
        "pretrain-translation",
        help="train an English-Spanish Marian from scratch on the Bible verse pairs",
        description="Trains a shared BPE on the training verses (`blockdecode bible` writes them), then a "
        "MarianMTModel with label smoothing, evaluating held-out loss and greedy BLEU on the validation "
        "verses. --resume continues a stopped run.",
    )
    p.add_argument("--corpus", required=True, help="folder holding train.tsv and valid.tsv")
    p.add_argument("--out", required=True, help="tokenizer/, checkpoints, metrics.jsonl, translation.png, model/")
    p.add_argument(
        "--tokenizer",
        help="a folder whose tokenizer to use instead of training one (a draft model shares its target's)",
    )
    ints = ("vocab_size", "hidden_size", "encoder_layers", "decoder_layers", "heads", "intermediate_size", "context")
    ints += ("steps", "batch_tokens", "warmup_steps", "eval_every", "eval_verses", "checkpoint_every")
    add_run_arguments(p, d, ints, ("lr", "min_lr", "weight_decay", "label_smoothing"))
    say_what_may_change(p, TranslationConfig, RESUME_MUST_MATCH)
    p.set_defaults(func=cmd_pretrain_translation)


def causal_only(model_dir: str | None, command: str) -> None:
    """`demo` (code) continues code prompts; an encoder-decoder model is refused by name."""
    config = Path(model_dir or "") / "config.json"
    if model_dir and config.is_file() and getattr(load_config(model_dir), "is_encoder_decoder", False):
        raise ValueError(
            f"`blockdecode {command}` continues code prompts with a causal LM; {model_dir} is an encoder-decoder "
            f"model: translate with `blockdecode demo --task translate --model {model_dir}` or `blockdecode generate "
            f"--model {model_dir} --prompt SOURCE --compare`"
        )


def cmd_bench(args: argparse.Namespace) -> None:
    from blockdecode.bench import (
        PRESETS,
        acceptance_markdown,
        batch_markdown,
        core_markdown,
        markdown,
        measure_bench,
        sampling_markdown,
        write_report,
    )

    preset = "quick" if args.quick else args.preset
    chosen = {"model": args.model, "draft": args.draft, "prompts": args.prompts}
    if args.dtype:  # the core study has no model of its own: its dtype is the scripted model's
        chosen["system_dtype" if preset == "core" else "dtype"] = args.dtype
    chosen["acceptance"] = [a for a in (args.acceptance or "").split(",") if a]
    if args.trees:
        chosen["trees"] = [t for t in args.trees if t is not None]
    for name in ("ks", "temperatures", "batches", "drafters"):
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    if args.corpus:
        chosen["corpus"] = tuple(args.corpus)
    for name in ("new_tokens", "n_prompts", "repeats", "out", "device"):
        if getattr(args, name):
            chosen[name] = getattr(args, name)
    if args.no_system:
        chosen["system"] = False
    if args.static_cache:
        chosen["static_cache"] = True
    cfg = PRESETS[preset](**chosen)
    report = measure_bench(cfg)  # printed before it is written: a folder that fails then loses no result
    if report["methods"]:
        print(markdown(report))
    if report.get("sampling"):
        print(f"\n{sampling_markdown(report['sampling'])}")
    if report.get("batches"):
        print(f"\n{batch_markdown(report['batches'])}")
    if cfg.acceptance:
        print("\nApproximate acceptance: NOT the exact greedy output; what each rule costs:\n")
        print(acceptance_markdown(report))
    if "system_ceiling" in report:
        print(f"\nScripted drafters (the decode loop alone):\n\n{core_markdown(report['system_ceiling'])}")
    write_report(report, Path(cfg.out))
    print(f"\nresults, plots and tables in {cfg.out} ({report['seconds']:.0f} s)", file=sys.stderr)


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="blockdecode against greedy, prompt lookup and assisted generation, side by side",
        description="Every method on the same model, prompts, dtype and threads, in one process, with interleaved "
        "rounds. Writes bench.json, speedup.png, blocks.png, batches.png, cost.png and table.md to --out. "
        "Presets: default; quick (about two minutes); core (the decode loop alone: scripted drafters on a "
        "GPT-2-small-sized model, dynamic and static cache).",
    )
    p.add_argument("--preset", choices=("default", "quick", "core"), default="default")
    p.add_argument("--quick", action="store_true", help="the same as --preset quick")
    p.add_argument("--model", default=None, help="a saved BlockwiseLM or transformers folder (default: built-in)")
    p.add_argument("--draft", default=None, help="draft model for assisted generation (default: built-in draft)")
    p.add_argument("--prompts", default=None, help="JSON list of prompt texts (default: held-out code)")
    p.add_argument(
        "--k",
        dest="ks",
        type=listed(positive_int),
        default=None,
        help="block sizes, comma-separated (default 2,4,6,8,10; --quick 2,4,8)",
    )
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default auto (core: fp32)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/bench, bench_quick or core)")
    p.add_argument("--new-tokens", type=positive_int, default=None)
    p.add_argument("--n-prompts", type=positive_int, default=None)
    p.add_argument("--repeats", type=positive_int, default=None)
    p.add_argument("--acceptance", default=None, help="approximate rules to measure too, e.g. topk:2,min-block:3")
    p.add_argument(
        "--temperatures",
        type=listed(temperature),
        default=None,
        help="sampling temperatures, comma-separated (default 0.7,1.0; quick 0.7), or off",
    )
    p.add_argument(
        "--batches",
        type=listed(positive_int),
        default=None,
        help="batch sizes against transformers' batched greedy, comma-separated (default 1,4,8; quick 4), or off",
    )
    p.add_argument(
        "--trees",
        type=tree_budgets,
        default=None,
        help="tree budgets to measure, comma-separated: N, auto (default) or expected, off",
    )
    p.add_argument(
        "--drafters",
        type=comma_names,
        default=None,
        help="drafters measured, comma-separated: heads, ngram or suffix, each a chain at every k and a tree, or "
        "several joined by + sharing a tree, e.g. heads,ngram,suffix,heads+suffix (default heads,ngram,heads+ngram)",
    )
    p.add_argument(
        "--corpus",
        action="append",
        metavar="PATH",
        help="a file or folder of text the --drafters with suffix lookup also draft from (repeatable; indexed once, "
        "cached in ~/.cache/blockdecode/corpus); each prompt is measured alone, no earlier output remembered",
    )
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--no-system", action="store_true", help="skip the GPT-2-small-sized scripted-drafter study")
    p.add_argument(
        "--static-cache", action="store_true", help="also greedy and the chains at the largest k with a static cache"
    )
    p.set_defaults(func=cmd_bench)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from blockdecode.commands.demo import PROMPTS
    from blockdecode.decoding.calibrate import cache_file, calibrate
    from blockdecode.model import load

    model, tokenizer = load(args.model, dtype_for(args.dtype), args.k)
    prompts = model.prompts or [tokenizer(t, return_tensors="pt").input_ids for t in PROMPTS]
    result = calibrate(model, prompts, args.drafter, args.k, refresh=args.refresh)
    chosen = f"trees of {result.tree}" if result.tree else "the chain"
    if not result.predicted:  # nothing could be measured: what --tree auto does instead, and why
        print(f"--tree auto decodes with {result.drafter}, {chosen}: {result.note}")
        return
    print(f"predicted tokens/s ({result.statistics} acceptance statistics, this machine's costs):")
    for name, curve in result.predicted.items():
        best = max(curve, key=curve.get)
        shown = sorted({"0", "1", "2", "4", "8", "16", "32", "64", best} & set(curve), key=int)
        print(
            f"{name:>12}: "
            + ", ".join(f"{'chain' if b == '0' else b}: {curve[b]:.0f}{'*' * (b == best)}" for b in shown)
        )
    print(f"\n--tree auto decodes with {result.drafter}, {chosen}, for {result.key} (chosen in {result.seconds:.1f} s)")
    if not result.note:  # else calibrate has said why it is not cached
        print(f"cached in {cache_file()}", file=sys.stderr)
    print_ranking(model, prompts[0], args.drafter, args.k)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure which tree budget decodes fastest here (what --tree auto uses)",
        description="Predicts the tokens/s of the chain and of every tree budget 1..64 for each drafter from "
        "acceptance statistics (shipped with a built-in model, else measured on its prompts) and this machine's "
        "cost curve t(q), and caches the fastest for this model, dtype, machine, threads, drafter and k.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="saved BlockwiseLM or transformers folder")
    p.add_argument("--drafter", choices=DRAFTER_CHOICES, default="auto", help="auto: choose the drafters too")
    p.add_argument("--k", type=positive_int, default=None, help="block size (default: the heads' k)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.set_defaults(func=cmd_calibrate)


def print_ranking(model, ids: torch.LongTensor, drafter: str, k: int | None, new_tokens: int = 96) -> None:
    """What --tree expected starts from, and how one decode of `ids` moves it."""
    from blockdecode.decoding.calibrate import explain_ranking
    from blockdecode.decoding.ranking import PRIORS

    plan = model.plan(drafter, k, "expected", prompts=[ids])
    rows, mean_tree = explain_ranking(model, plan, ids, new_tokens)
    print(
        f"\n--tree expected ranks each call's candidates by their chance to stand, from the priors in {PRIORS} "
        f"beside the model where it has one (else the drafters' own), moved by what stands. A decode of "
        f"{new_tokens} tokens of the first prompt held {mean_tree:.1f} candidates a call and moved them:"
    )
    print(f"{'source':24} {'prior':>6} {'after':>6} {'trials':>7}")
    for name, prior, after, trials in rows:
        print(f"{name:24} {prior:6.2f} {after:6.2f} {trials:7.1f}")


def cmd_export(args: argparse.Namespace) -> None:
    from blockdecode.loading import EAGLE3_FOLDER
    from blockdecode.model import BlockwiseLM
    from blockdecode.serving.export import check_destination, check_heads, export_heads, saved_heads, serve_command

    heads, record = saved_heads(args.model)  # what the heads are, and whether they can go, before any weight loads
    check_heads(heads, args.format)
    if args.format in EAGLE3_FORMATS and not (Path(args.model) / EAGLE3_FOLDER).is_dir():
        raise ValueError(f"{args.model} holds no EAGLE-3 drafter ({EAGLE3_FOLDER}/): train one with --head-type eagle3")
    check_destination(Path(args.out))
    dtype = saved_dtype(args.model) if args.dtype == "saved" else DTYPES[args.dtype]
    model = BlockwiseLM.from_pretrained(args.model, dtype=dtype).to(dtype).eval()
    has_tokenizer = (Path(args.model) / "tokenizer_config.json").is_file()  # written beside a base saved with it
    tokenizer = load_tokenizer(args.model) if has_tokenizer else None
    training = record.get("training")
    provenance = {"exported_from": str(Path(args.model).resolve()), **({"training": training} if training else {})}
    base = export_heads(model, args.out, args.format, tokenizer=tokenizer, provenance=provenance)
    if args.format in EAGLE3_FORMATS:
        k = model.eagle3.config.speculative_tokens + 1
        print(f"exported an EAGLE-3 drafter ({args.format}) to {args.out}; serve it with one of:")
    else:
        k = model.k
        print(f"exported {model.k - 1} medusa heads to {args.out}; serve them with:")
    print(serve_command(base, args.out, k, args.format))


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write trained heads or an EAGLE-3 drafter in a serving engine's format",
        description="vllm-medusa writes medusa heads as vLLM loads a Medusa speculator (config.json, "
        "model.safetensors with the base's output layer once and the draft vocabulary as token_map). speculators "
        "writes the model's EAGLE-3 drafter in vLLM's speculators format (Eagle3Speculator), eagle3 in the original "
        "LlamaForCausalLMEagle3 layout that SGLang and llama.cpp's converter read. Each is written whole or not at "
        "all, and the commands that serve it are printed. A base saved together with its heads is written to "
        "OUT/base as well.",
    )
    p.add_argument("--model", required=True, help="a saved BlockwiseLM with medusa heads, or an EAGLE-3 drafter")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="vllm-medusa")
    p.add_argument("--out", required=True, help="an empty folder, or an earlier export to replace")
    p.add_argument("--dtype", choices=("saved", *DTYPES), default="saved", help="saved: as the heads were saved")
    p.set_defaults(func=cmd_export)


def saved_dtype(model_dir: str) -> torch.dtype:
    """The dtype the heads were saved in (their safetensors), so an export changes no weight."""
    from safetensors import safe_open

    from blockdecode.loading import HEADS_WEIGHTS

    with safe_open(str(Path(model_dir) / HEADS_WEIGHTS), "pt") as f:
        names = [n for n in f.keys() if f.get_slice(n).get_dtype() != "I64"]
        return f.get_tensor(names[0]).dtype if names else torch.float32


def cmd_bible(args: argparse.Namespace) -> None:
    from blockdecode.pretraining.bible import open_sources, read_pairs, read_sources, sources_file, write_corpus

    check_writable(Path(args.out))  # before the modules are read, not after
    extra = open_sources(args.modules, args.extra_sources)  # a module not there fails before any reading
    pairs = read_pairs(args.modules)
    sources = read_sources(extra, pairs)
    counts = write_corpus(pairs, args.out, sources)
    split = ", ".join(f"{name} {n:,}" for name, n in counts.items())
    print(f"{sum(counts.values()):,} verse pairs in {args.out}: {split}")
    for name, lines in sources.items():
        what = "sentences of commentary" if extra[name].commentary else "English verses"
        print(f"{len(lines):,} {what} on training chapters from {extra[name].name} in {sources_file(name)}")


def add_bible_parser(sub) -> None:
    p = sub.add_parser(
        "bible",
        help="write the English-Spanish verse pairs (KJV, Reina-Valera 1909) for translation",
        description="Reads the engKJV2006eb and spaRV1909eb SWORD modules with pysword and writes train.tsv, "
        "valid.tsv and test.tsv (reference, English, Spanish), split by a hash of book and chapter. Get the "
        "modules with: apt-get download sword-text-kjv sword-text-sparv; dpkg-deb -x each .deb into DIR; then "
        "--modules DIR/usr/share/sword.",
    )
    p.add_argument("--modules", required=True, help="SWORD module folder (the one holding mods.d/)")
    p.add_argument("--out", default="runs/bible", help="where the .tsv files go")
    p.add_argument(
        "--extra-sources",
        type=comma_names,
        default=[],
        help="comma-separated English modules whose training-chapter text goes to OUT/sources-NAME.txt, one "
        "source a line, for train --distill-sources: web (World English Bible: sword-text-web), mhcc, scofield, "
        "tdavid (commentaries: sword-comm-*), or a module's own name",
    )
    p.set_defaults(func=cmd_bible)


def cmd_demo(args: argparse.Namespace) -> None:
    from blockdecode.commands.demo import run_demo

    if args.task == "code":
        causal_only(args.model, "demo")
    check_drafter(args.drafter, args.tree)
    check_corpus(args.drafter, args.corpus)
    run_demo(
        args.model,
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        dtype=dtype_for(args.dtype),
        drafter=args.drafter,
        tree=args.tree,
        task=args.task,
        heal=args.heal,
        corpus=[Path(p) for p in args.corpus] if args.corpus else None,
    )


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="show blockwise decoding against greedy on the built-in model")
    p.add_argument("--model", default=None, help="a saved BlockwiseLM (default: the built-in model)")
    p.add_argument(
        "--task", choices=("code", "translate"), default="code", help="translate: an encoder-decoder, Bible verses"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--k", type=positive_int, default=None, help="block size (default: the heads' k)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bf16 where native, else fp32")
    p.add_argument(
        "--drafter", choices=DRAFTER_CHOICES, default="auto", help="where proposals come from (auto: measured)"
    )
    p.add_argument(
        "--tree",
        type=tree_budget,
        default="default",
        help="N candidates a call, expected (ranked; default, greedy), auto (measured; default, sampling), off",
    )
    p.add_argument("--no-heal", dest="heal", action="store_false", help=NO_HEAL)
    add_corpus_flag(p)
    p.set_defaults(func=cmd_demo)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning as a line of the command's own, without Python's file, line and source."""
    print(f"warning: {message}", file=sys.stderr)


COMMANDS = (
    add_generate_parser,
    add_train_parser,
    add_pretrain_parser,
    add_pretrain_translation_parser,
    add_bench_parser,
    add_calibrate_parser,
    add_export_parser,
    add_bible_parser,
    add_demo_parser,
)
"""Each adds its command's subparser, with `func` set to its `cmd_<command>`."""


def main(argv: list[str] | None = None) -> None:
    stay_offline()
    parser = Parser(prog="blockdecode", description=__doc__)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in COMMANDS:
        add_parser(sub)

    args = parser.parse_args(argv)
    if args.threads:
        if args.threads > 4 * (os.cpu_count() or 1):
            parser.error(f"--threads {args.threads}: this machine has {os.cpu_count()} CPUs")
        torch.set_num_threads(args.threads)
    if getattr(args, "prompt", None) == "-":
        args.prompt = sys.stdin.read()
    if getattr(args, "prompt", None) is not None and not is_text(args.prompt):
        parser.error("--prompt is not valid UTF-8 text")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            args.func(args)
    except KeyboardInterrupt:
        resume = " (the last checkpoint is kept: run it again with --resume)" if args.command in TRAINING else ""
        print(f"interrupted{resume}", file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from err


TRAINING = ("train", "pretrain", "pretrain-translation")


def stay_offline() -> None:
    """The command never reaches a model hub unless HF_HUB_OFFLINE=0 says it may. The variable is
    read when huggingface_hub is imported, before this runs, so the setting goes to its module."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_OFFLINE") is None and os.environ.get("TRANSFORMERS_OFFLINE") is None:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for child processes (torchrun, accelerate launch)
        constants.HF_HUB_OFFLINE = True


if __name__ == "__main__":
    main()
