"""Training an EAGLE-3 drafter on a frozen base (`--head-type eagle3`): the training-time test over k-1 draft
steps, on the base's own argmax, its layers' features cached or computed each step."""

from __future__ import annotations

import math
import random
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedModel

from blockdecode.core import plots
from blockdecode.core.hf import layer_inputs, vocab_size
from blockdecode.core.io import write_json
from blockdecode.decoding.loop import decode_prompts
from blockdecode.decoding.plan import make_plan
from blockdecode.drafters.eagle3.config import config_for
from blockdecode.drafters.eagle3.model import Eagle3, ttt_loss
from blockdecode.drafters.heads import most_frequent
from blockdecode.loading import HEADS_CONFIG, has_heads
from blockdecode.model import BlockwiseLM
from blockdecode.training import loop as training
from blockdecode.training.config import TrainConfig
from blockdecode.training.data import Pairs, batch_indices, decoder_rows, eval_prompts
from blockdecode.training.distill import distill_sequences
from blockdecode.training.features import Features, cached_features, row_logits


class Eagle3Objective(torch.nn.Module):
    """An EAGLE-3 drafter and the frozen base it reads, as one module for accelerate: its forward is the
    training-time test's loss on a batch (`Eagle3.loss`), the base's features read from the cache or computed."""

    layers_attribute = "aux_layers"  # the drafter config's field naming the base's layers it reads

    def __init__(self, drafter: Eagle3, base: PreTrainedModel):
        super().__init__()
        self.drafter = drafter
        self.base = [base]  # not a submodule: frozen, not saved, not wrapped
        self.embed = base.get_input_embeddings()

    def features(self, tokens: torch.LongTensor | Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's features at the drafter's layers, and its argmax, on rows `tokens` (-1 as padding; an
        encoder-decoder's pairs: at its decoder's positions, the source encoded)."""
        base = self.base[0]
        with torch.no_grad(), layer_inputs(base, getattr(self.drafter.config, self.layers_attribute)) as aux:
            logits = row_logits(base, tokens)
        return aux[0].float(), logits.argmax(-1)

    def forward(self, tokens: torch.LongTensor, aux: torch.Tensor | None = None, argmax=None, steps: int = 1):
        if aux is None:
            aux, argmax = self.features(tokens)
        targets = argmax.long().masked_fill(tokens < 0, -1)
        targets[:, :-1] = targets[:, :-1].masked_fill(tokens[:, 1:] < 0, -1)  # no next token: nothing to learn
        return self.drafter.loss(self.embed, aux.to(self.drafter.fc.weight.dtype), tokens, targets, steps)


class Eagle3Training(training.Task):
    """An EAGLE-3 drafter trained on a frozen base (`--head-type eagle3`): the training-time test over k-1
    draft steps, on the base's own argmax, the features of its layers cached (`--feature-cache`) or computed
    each step (several processes)."""

    name = "eagle3"
    last = HEADS_CONFIG
    curves = plots.Curves(heldout={"eval_loss": "held-out loss"}, ylabel=None, side=plots.head_accuracy)

    def __init__(self, cfg: TrainConfig, lm: BlockwiseLM, objective, sequences, held_out, digest, tokenizer, acc):
        self.config, self.lm, self.model, self.tokenizer, self.accelerator = cfg, lm, objective, tokenizer, acc
        self.sequences, self.held_out, self.data_digest = sequences, held_out, digest
        self.features: Features | None = None
        self.coverage: float | None = None
        self.row_tokens = float((decoder_rows(sequences) >= 0).sum()) / len(sequences)
        self.optimizer = training.adamw(objective.drafter, cfg.lr, cfg.weight_decay, (0.9, 0.95))
        self.scheduler = training.scheduler(self.optimizer, cfg.warmup_steps, cfg.steps, floor=0.1)
        self.tallies = torch.zeros(cfg.k - 1, 2)

    def batch(self, step: int) -> tuple[torch.LongTensor | Pairs, torch.Tensor | None, torch.Tensor | None]:
        """This process's rows at `step` (an encoder-decoder's pairs), with the base's cached features and argmax on
        them, at the decoder's positions (None: computed)."""
        cfg, acc = self.config, self.accelerator
        idx = batch_indices(step, len(self.sequences), cfg.batch_size, cfg.seed)[acc.process_index :: acc.num_processes]
        tokens = self.sequences[idx].to(acc.device)
        if self.features is None:
            return tokens, None, None
        aux, argmax = self.features.rows(idx, decoder_rows(tokens).shape[1], acc.device, ("aux", "argmax"))
        return tokens, aux, argmax

    def loss(self, model, step: int) -> tuple[torch.Tensor, int]:
        cfg, acc = self.config, self.accelerator
        world = acc.num_processes
        tokens, aux, argmax = self.batch(step)
        sums, tallies = model(tokens, aux, argmax, cfg.k - 1)
        tallies = acc.reduce(tallies.to(acc.device), reduction="sum").cpu()
        self.tallies += tallies
        # DDP averages gradients over processes; scaling by `world` turns that into the global batch's mean.
        return ttt_loss(sums, tallies[:, 1]) * world, tokens.numel()

    def logged(self) -> dict:
        accuracy = (self.tallies[:, 0] / self.tallies[:, 1].clamp(min=1)).tolist()
        self.tallies.zero_()
        return {"head_acc": accuracy}  # per draft step, as the heads' plot shows each head

    @torch.inference_mode()
    def evaluate(self, model: Eagle3Objective) -> dict:
        """Held-out loss and accuracy at each draft step, and the mean accepted block of the drafter's chain
        decoding held-out prompts."""
        cfg, device = self.config, self.accelerator.device
        was_training = model.training
        model.eval()
        sums, tallies = torch.zeros(cfg.k - 1), torch.zeros(cfg.k - 1, 2)
        for b in range(min(cfg.eval_batches, math.ceil(len(self.held_out) / cfg.batch_size))):
            s, t = model(self.held_out[b * cfg.batch_size : (b + 1) * cfg.batch_size].to(device), steps=cfg.k - 1)
            sums, tallies = sums + s.float().cpu(), tallies + t
        self.lm.eagle3 = model.drafter
        prompts, budget, eos = eval_prompts(self.lm.base, self.held_out, cfg)
        plan = make_plan(self.lm.base, self.lm.eagle3_drafter(), cfg.k, eos_token_id=eos)
        _, stats = decode_prompts(self.lm.base, prompts, budget, plan)
        model.train(was_training)
        return {
            "eval_loss": float(ttt_loss(sums, tallies[:, 1])),
            "eval_head_acc": (tallies[:, 0] / tallies[:, 1].clamp(min=1)).tolist(),
            "eval_mean_block_size": stats.mean_block_size,
        }

    def state(self, model: Eagle3Objective) -> dict:
        return {"heads": model.drafter.state_dict(), "python_rng": random.getstate()}

    def load_state(self, state: dict) -> None:
        self.model.drafter.load_state_dict(state["heads"])
        random.setstate(state["python_rng"])

    def save(self, model: Eagle3Objective, records: list[dict], folder: Path) -> None:
        """The drafter (eagle3/, the speculators format) beside the heads of the model it was trained on, which
        it names as its base, with the run's record."""
        record = eagle3_record(records, self.config, self.row_tokens, self.coverage, model.drafter.config.aux_layers)
        self.lm.eagle3 = model.drafter
        self.lm.write_save(folder, save_base=False, training=record, tokenizer=self.tokenizer)


def eagle3_record(records: list[dict], cfg: TrainConfig, row_tokens: float, coverage, aux_layers) -> dict:
    """What a saved model keeps of an EAGLE-3 run: its settings, how much it saw, and its last held-out
    evaluation (the training-time test's loss and each draft step's accuracy, and the block its chain accepted)."""
    evals = [r for r in records if "eval_loss" in r]
    steps = max((r["step"] for r in records), default=0)
    return {
        "head_type": "eagle3",
        "mode": cfg.mode,
        "k": cfg.k,
        "aux_layers": list(aux_layers),
        **({"draft_vocab": cfg.draft_vocab, "draft_vocab_coverage": coverage} if cfg.draft_vocab else {}),
        "steps": steps,
        "tokens_seen": round(steps * cfg.batch_size * row_tokens),
        "heldout_loss": evals[-1]["eval_loss"] if evals else None,
        "heldout_accuracy_by_step": evals[-1]["eval_head_acc"] if evals else None,
        "mean_block_size": evals[-1]["eval_mean_block_size"] if evals else None,
    }


def train_eagle3(cfg: TrainConfig, loop, base, tokenizer, train_seqs, held_out, digest, state, callback) -> BlockwiseLM:
    """`train` for `--head-type eagle3`: a drafter on the frozen base, beside the heads `cfg.base` holds (or
    untrained ones); the model it saves decodes with drafter="eagle3" and exports to the serving engines."""
    acc = loop.accelerator
    if has_heads(cfg.base):
        lm = BlockwiseLM.from_pretrained(cfg.base, base=base)
    else:
        lm = BlockwiseLM.from_base(base, k=cfg.k)
    lm.base_location = lm.base_location or str(Path(cfg.base).resolve())
    vocab = vocab_size(base)
    mlp = {"intermediate_size": cfg.head_hidden_size} if cfg.head_hidden_size else {}  # else the base's MLP width
    drafter = Eagle3(config_for(base, cfg.draft_vocab or vocab, cfg.aux_layers, cfg.k, **mlp))  # layers checked now
    if cfg.distill:
        with acc.main_process_first():
            train_seqs = distill_sequences(base.to(acc.device), train_seqs, cfg, show=loop.main)
    token_map, coverage = most_frequent(train_seqs, vocab, cfg.draft_vocab or vocab)
    drafter.set_vocabulary(token_map)
    base.requires_grad_(False)
    objective = Eagle3Objective(drafter.to(acc.device), base.to(acc.device)).train()
    task = Eagle3Training(cfg, lm, objective, train_seqs, held_out, digest, tokenizer, acc)
    fit_drafter(task, loop, coverage, drafter.config.aux_layers, state, callback)
    return lm


def fit_drafter(task: Eagle3Training, loop, coverage: float, layers: tuple[int, ...], state, callback) -> None:
    """A drafter's run (EAGLE-3's or DFlash's): its draft vocabulary's coverage kept, the features of `layers`
    cached where asked (one process), its config written, then the loop."""
    cfg = task.config
    task.coverage = coverage if cfg.draft_vocab else None
    if cfg.feature_cache:
        if loop.accelerator.num_processes > 1:
            raise ValueError("--feature-cache serves one process; several train with the base computed each step")
        base = task.lm.base
        task.features = cached_features(base, task.sequences, cfg.feature_cache, show=loop.main, layers=layers)
    if loop.main:
        write_json(Path(cfg.out) / "train_config.json", asdict(cfg))
    loop.fit(task, state, callback)
