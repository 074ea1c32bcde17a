"""BlockwiseLM: a transformers causal LM plus proposal heads, saved and loaded as one."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockdecode.chat import reply_to
from blockdecode.core.hf import (
    check_loaded,
    context_length,
    eval_mode,
    is_seq2seq,
    output_projection,
    weights_signature,
)
from blockdecode.core.io import CheckpointError, saving_folder, write_text
from blockdecode.decoding.acceptance import Acceptance
from blockdecode.decoding.arguments import Extras, check_beside_plan
from blockdecode.decoding.choice import LOOKUP_DEPTH, choose_plan
from blockdecode.decoding.healing import check_healing, heal_prompts
from blockdecode.decoding.inputs import check_attention_mask, check_prompt, row_tokens
from blockdecode.decoding.output import BlockwiseOutput
from blockdecode.decoding.plan import DecodePlan
from blockdecode.decoding.sampling import check_generator
from blockdecode.drafters.base import Drafter
from blockdecode.drafters.dflash.config import check_dflash
from blockdecode.drafters.dflash.drafting import DFlashDrafter
from blockdecode.drafters.dflash.model import DFlash
from blockdecode.drafters.eagle3.config import check_eagle3
from blockdecode.drafters.eagle3.drafting import Eagle3Drafter
from blockdecode.drafters.eagle3.model import Eagle3
from blockdecode.drafters.heads import HEAD_TYPES, HeadsConfig, HeadsDrafter, build_heads
from blockdecode.drafters.sources import Memory, SuffixArray, corpus_index
from blockdecode.drafters.suffix import SuffixDrafter
from blockdecode.loading import (
    DFLASH_FOLDER,
    EAGLE3_FOLDER,
    HEADS_CONFIG,
    HEADS_WEIGHTS,
    _location,
    read_model,
)

Corpus = str | os.PathLike | SuffixArray | Sequence[str | os.PathLike | SuffixArray]


def load(
    directory: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    k: int | None = None,
    head_type: str | None = None,
) -> tuple[BlockwiseLM, object]:
    """`BlockwiseLM.from_pretrained` in eval mode and in `dtype`, and its tokenizer, which it must have."""
    model = BlockwiseLM.from_pretrained(directory, k=k, head_type=head_type, dtype=dtype)
    if model.tokenizer is None:
        where = f"{directory}" + (f" nor its base {model.base_location}" if model.base_location else "")
        raise CheckpointError(f"no tokenizer in {where}: save one beside the model (tokenizer.save_pretrained)")
    return model.to(dtype).eval(), model.tokenizer


class BlockwiseLM(nn.Module):
    """`base` (any transformers causal LM) with `heads` that propose tokens 2..k ahead.

    The heads share the base model's output projection, so they add one small layer and no
    vocabulary-sized weights."""

    def __init__(self, base: PreTrainedModel, config: HeadsConfig, base_location: str | None = None):
        """`base_location`: where the base can be loaded from again (a folder or hub name), None
        if it exists only in memory; a heads-only save records it."""
        super().__init__()
        self.base = base
        self.config = config
        self.base_location = base_location
        self.prompts: list[torch.LongTensor] = []  # what plan() measures on unless given some: load() sets them
        self.tokenizer = None  # what a corpus given to generate is tokenized with: load() sets it
        self.memory = Memory()  # this process's outputs, for suffix lookup (generate's remember)
        self.heads_trained = True  # False for from_base's fresh heads: the default then drafts by lookup alone
        self.default_drafters: str | None = None  # what drafter="auto" ranks, where measured for this model and saved
        projection = output_projection(base)
        base_hidden = projection.weight.shape[1]
        base_vocab = projection.weight.shape[0]
        if config.hidden_size != base_hidden:
            raise CheckpointError(
                f"heads were built for hidden size {config.hidden_size}, the base model's is {base_hidden}"
            )
        if config.vocab_size != base_vocab:
            raise CheckpointError(
                f"heads were built for a vocabulary of {config.vocab_size}, the base model's is {base_vocab}"
            )
        embedding = base.get_input_embeddings().weight.shape[1]
        if config.head_type == "hydra" and config.embed_size != embedding:
            raise CheckpointError(
                f"hydra heads were built for input embeddings of width {config.embed_size}, the base model's "
                f"are {embedding}"
            )
        self.heads = build_heads(config).to(device=projection.weight.device, dtype=projection.weight.dtype)
        self.eagle3: Eagle3 | None = None  # an EAGLE-3 drafter on this base (`attach_eagle3`)
        self.priors_folder: str | None = None  # the folder its drafters were read from, where their rates may lie
        self.dflash: DFlash | None = None  # a DFlash block drafter on this base (`attach_dflash`)

    @classmethod
    def from_base(
        cls,
        base: PreTrainedModel,
        k: int = 8,
        head_type: str = "paper",
        head_hidden_size: int = 0,
        draft_vocab: int = 0,
    ) -> BlockwiseLM:
        """Untrained heads on `base`: exact from the start, fast once trained. `draft_vocab=N`: the heads
        score N tokens only (the first N ids until `token_map` is set, as training does from its data)."""
        projection = output_projection(base)
        cfg = HeadsConfig(
            k=k,
            head_type=head_type,
            hidden_size=projection.weight.shape[1],
            head_hidden_size=head_hidden_size,
            vocab_size=projection.weight.shape[0],
            draft_vocab=draft_vocab,
            embed_size=base.get_input_embeddings().weight.shape[1] if head_type == "hydra" else 0,
        )
        context = context_length(base)
        if context is not None and cfg.k > context:
            raise ValueError(f"k={cfg.k} exceeds the model's context of {context} positions")
        gib = cfg.parameters() * projection.weight.element_size() / 2**30
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
        if memory is not None and gib > memory / 2:  # refused before the memory is asked for
            raise ValueError(
                f"k={k} needs {cfg.head_type} heads of {gib:,.1f} GiB, more than half this machine's "
                f"{memory:,.0f} GiB: choose a smaller k (or a smaller head_hidden_size)"
            )
        model = cls(base, cfg, base_location=_location(getattr(base, "name_or_path", "")))
        model.heads_trained = False
        return model

    @property
    def k(self) -> int:
        return self.config.k

    def drafter(self, rescore: float = 0.0) -> HeadsDrafter:
        """The paper's proposals from these heads, over their draft vocabulary if they have one
        (`rescore`: see HeadsDrafter)."""
        heads = getattr(self, "heads", None)
        if not isinstance(heads, nn.Module):
            raise TypeError(
                f"this BlockwiseLM's heads are {type(heads).__name__}, not a module: it has no heads to propose with "
                f"(decode with drafter='ngram', or load it again)"
            )
        check_loaded(heads, "the heads")
        return HeadsDrafter(
            heads,
            output_projection(self.base),
            rescore=rescore,
            token_map=self.token_map,
            embeddings=self.base.get_input_embeddings(),
        )

    @property
    def measured(self) -> nn.ModuleList:
        """The base and its heads: what a model's shipped statistics and a calibration are of, so that giving it
        an EAGLE-3 drafter leaves them valid. The same object while those are the same modules."""
        parts = [m for m in (self.base, getattr(self, "heads", None)) if isinstance(m, nn.Module)]  # heads may be gone
        known = self.__dict__.get("_measured")
        if known is None or list(known) != parts:
            known = self.__dict__["_measured"] = nn.ModuleList(parts)
        return known

    def attach_eagle3(self, eagle3: Eagle3 | str | os.PathLike, where: object = None) -> None:
        """Give this model an EAGLE-3 drafter (`drafter="eagle3"`): a module (read from `where`, if it was), or a
        folder holding one in the speculators or the original layout; refused in one line if it was built for
        another base."""
        self._check_decoder_only()
        if not isinstance(eagle3, Eagle3):
            where, eagle3 = eagle3, Eagle3.load(eagle3)
        check_eagle3(eagle3.config, self.base, where)
        projection = output_projection(self.base)
        self.eagle3 = eagle3.to(device=projection.weight.device, dtype=projection.weight.dtype).eval()

    def _check_decoder_only(self) -> None:
        """EAGLE-3 reads a decoder-only base's layers: an encoder-decoder drafts with heads, lookups and DFlash."""
        if is_seq2seq(self.base):
            raise ValueError(
                f"EAGLE-3 drafters read a decoder-only base's layers; {type(self.base).__name__} is an encoder-decoder:"
                " draft with heads, dflash, ngram or suffix lookup"
            )

    def eagle3_drafter(self) -> Eagle3Drafter:
        """drafter="eagle3": proposals from this model's EAGLE-3 drafter."""
        self._check_decoder_only()
        if self.eagle3 is None:
            raise ValueError(
                "this model has no EAGLE-3 drafter: train one with `blockdecode train --head-type eagle3`, or "
                "attach a saved one (attach_eagle3, --eagle3)"
            )
        return Eagle3Drafter(self.eagle3, self.base.get_input_embeddings())

    def attach_dflash(self, dflash: DFlash | str | os.PathLike, where: object = None) -> None:
        """Give this model a DFlash block drafter (`drafter="dflash"`): a module (read from `where`, if it was), or a
        folder holding one in z-lab's layout or the speculators format; refused in one line if it was built for
        another base."""
        if not isinstance(dflash, DFlash):
            where, dflash = dflash, DFlash.load(dflash)
        check_dflash(dflash.config, self.base, where)
        projection = output_projection(self.base)
        self.dflash = dflash.to(device=projection.weight.device, dtype=projection.weight.dtype).eval()

    def dflash_drafter(self) -> DFlashDrafter:
        """drafter="dflash": proposals from this model's DFlash drafter, a whole block a pass."""
        if self.dflash is None:
            raise ValueError(
                "this model has no DFlash drafter: train one with `blockdecode train --head-type dflash`, or "
                "attach a saved one (attach_dflash)"
            )
        return DFlashDrafter(self.dflash, self.base)

    @property
    def token_map(self) -> torch.LongTensor | None:
        """The ids the heads score (their draft vocabulary), or None for the whole vocabulary."""
        return self.heads.token_map if self.config.draft_vocab else None

    def head_logits(self, hidden: torch.Tensor, tokens: torch.LongTensor | None = None) -> torch.Tensor:
        """Decoder outputs [..., D] -> logits of heads p2..pk [..., k-1, V]. Hydra heads also take
        `tokens` [..., k-1]: the base's newest token and the tokens before each later head's own."""
        embeds = None if tokens is None else self.base.get_input_embeddings()(tokens)
        return self.base.get_output_embeddings()(self.heads(hidden, embeds))

    plan = choose_plan  # lm.plan(...): every setting of a decode, resolved and checked once
    chat = reply_to  # lm.chat(messages, tokenizer=None, max_new_tokens=256, **generate_kwargs): the next reply

    def generate(
        self,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        drafter: str | Drafter | Sequence[Drafter] | None = "auto",
        k: int | None = None,
        cache_implementation: str = "dynamic",
        on_block: Callable[[list[int]], None] | None = None,
        acceptance: str | Acceptance | None = None,
        tree: int | str | None = "default",
        plan: DecodePlan | None = None,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        heal: PreTrainedTokenizerBase | None = None,
        remember: bool = True,
        corpus: Corpus | None = None,
        **kwargs: object,
    ) -> BlockwiseOutput:
        """Exact greedy decoding, several tokens per base-model call; or, with `do_sample=True`,
        sampling from exactly the distribution of `base.generate(do_sample=True, temperature=...,
        top_k=..., top_p=...)`, the proposals verified by speculative sampling.

        By default (`drafter="auto"`, `tree="default"`) n-gram lookup's and the heads' candidates are
        ranked each call by their chance to stand, learnt from what stood in this sequence, and the tree
        is sized for the most tokens a second on this machine (`tree="expected"`, `blockdecode.decoding.ranking`);
        `tree="auto"` takes the drafters and tree budget predicted fastest for this model, dtype, machine
        and k once, then cached (`blockdecode.decoding.calibrate`). `drafter`:
        a name ("heads", "ngram", "heads+ngram", "heads-rescored"), a Drafter, or a list of them
        sharing a tree. `tree=N` verifies a tree of up to N candidate tokens a call, `tree=None` one
        chain (a drafter object decodes its chain unless told otherwise). k defaults to the heads'
        block size; with the heads it may not exceed it. `acceptance` (topk:N, distance:EPS,
        min-block:L) trades exactness for speed; exact by default. Sampling settings left None come
        from the model's generation config, else transformers' defaults (temperature 1, top_k 50, top_p
        1), as for `generate`; top_k=0 and top_p=1.0 are off. Sampling verifies one chain a call: a
        tree asked for is decoded as a chain, with a warning. `generator` (a torch.Generator on the
        model's device) supplies every random draw, so a seed gives the same tokens. `plan`, if given
        (`lm.plan(...)`), replaces all of these settings but `generator`, so that many prompts share
        one resolution; any of them given beside it is refused. A model in training mode decodes in
        eval mode (no dropout: greedy's output) and is left in its modes.

        `input_ids` [B, T] with `attention_mask` [B, T] (0 on padding: on the left for a decoder-only
        model, as `transformers` pads for `generate`) decodes a batch: each row accepts its own block
        every call and stops at its own EOS or budget, and `sequences` is padded after each row's end
        as `generate` pads it; `row_stats` holds each row's stats. A batch verifies one chain a row:
        tree="auto" takes the drafter whose chain is predicted fastest, a tree budget is decoded as the
        first drafter's chain, with a warning.

        `heal=tokenizer` heals every prompt that ends mid-token, such as in a bare newline or space
        (`blockdecode.decoding.healing`): its last token is dropped, and the new tokens write its text again as
        the model would have split it. `sequences` then holds the shorter prompt and the new tokens, which
        decode to the prompt's text and its continuation, exactly as `base.generate` gives them with the
        healing's `prefix_allowed_tokens_fn`.

        Suffix lookup (`drafter="suffix"` or `"heads+suffix"`, or a `SuffixDrafter` in the drafters or the
        plan) drafts from three sources: the sequence itself; with `remember` (the default), this model's
        earlier outputs in this process, each row's prompt and output as `generate` returned them (the
        newest `sources.MemoryConfig.limit` tokens; `forget()` empties them), to which this decode's are
        added; and `corpus`, files and folders (a `Path`, or a str naming an existing one; folders are
        read recursively, files that are not UTF-8 text skipped), texts (any other str) or indexes from
        `sources.corpus_index`, tokenized by `model.tokenizer` (set by `load`), indexed once and cached
        (`sources.cache_dir()`). `remember=False`: the decode neither reads nor adds to the memory. A corpus
        given to the default (`drafter="auto"`) adds suffix lookup to its drafters, as `stats.note` says; given
        where named drafters hold no SuffixDrafter, it is refused (it would be ignored).

        As `transformers`' generate: `eos_token_id` an id or a list (default: the generation config's), `stop_strings`
        (with `tokenizer`, default `model.tokenizer`), `streamer` (fed each block as it stands) and `pad_token_id`;
        any other keyword of its generate is ignored with a warning naming it (`blockdecode.decoding.arguments`)."""
        extras = Extras.read(f"{type(self).__name__}.generate", kwargs, self.base, self.tokenizer)
        input_ids = check_prompt(self.base, input_ids, max_new_tokens, attention_mask)  # before any planning
        mask = check_attention_mask(self.base, input_ids, attention_mask)
        check_generator(generator, self.base.device)
        settings = dict(
            drafter=drafter,
            k=k,
            tree=tree,
            acceptance=acceptance,
            eos_token_id=eos_token_id,
            cache_implementation=cache_implementation,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        if plan is not None:
            if not isinstance(plan, DecodePlan):
                raise TypeError(
                    f"plan takes a DecodePlan from model.plan(...), got {type(plan).__name__} {plan!r}: a drafter by "
                    "name goes to drafter="
                )
            check_beside_plan(settings, self.generate)
        healing = None
        if heal is not None:
            healing = heal_prompts(heal, input_ids, mask)
            input_ids, mask = healing.input_ids, healing.attention_mask
            check_healing(self.base, healing, input_ids, mask)  # an encoder-decoder fails before any planning
        with eval_mode(self):  # the heads too, while they are planned with and propose
            if plan is None:
                rows = [input_ids.new_tensor([tokens]) for tokens in row_tokens(input_ids, mask)]
                plan = self.plan(**settings, prompts=rows, rows=len(rows), corpus=corpus is not None)
            plan = self.with_sources(plan, remember, corpus, heal)
            out = extras.decode(self.base, input_ids, max_new_tokens, plan, on_block, generator=generator,
                                attention_mask=mask, healing=healing)  # fmt: skip
        if remember and any(isinstance(d, SuffixDrafter) for d in plan.drafters):
            self.memory.add(self._rows_of(out, mask))
        return out

    def with_sources(
        self,
        plan: DecodePlan,
        remember: bool = True,
        corpus: Corpus | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> DecodePlan:
        """`plan` with each SuffixDrafter made anew for one decode (`SuffixDrafter.using`), reading this
        model's memory if `remember` and `corpus` beside its own (tokenized by `self.tokenizer`, else
        `tokenizer`). A corpus given to a plan that holds no SuffixDrafter is refused (it would be ignored);
        `remember=False` is always allowed: such a plan neither reads nor adds to the memory anyway."""
        if not any(isinstance(d, SuffixDrafter) for d in plan.drafters):
            if corpus is not None:
                raise ValueError(
                    f"corpus= would be ignored: only suffix lookup reads it, and this decode's drafters "
                    f"({plan.drafter_name}) hold none: pass drafter='suffix' or 'heads+suffix'"
                )
            return plan
        arrays = self._corpus(corpus, tokenizer) if corpus is not None else ()
        memory = self.memory if remember else None
        drafters = tuple(d.using(memory, arrays) if isinstance(d, SuffixDrafter) else d for d in plan.drafters)
        return dataclasses.replace(plan, drafters=drafters)

    def _corpus(self, corpus: Corpus, tokenizer: PreTrainedTokenizerBase | None) -> tuple[SuffixArray, ...]:
        """The indexes of what `corpus` names (`sources.corpus_index`), one per tokenized part."""
        items = [corpus] if isinstance(corpus, str | os.PathLike | SuffixArray) else list(corpus)
        arrays = tuple(c for c in items if isinstance(c, SuffixArray))
        named = [c for c in items if not isinstance(c, SuffixArray)]
        if not named:
            return arrays
        tokenizer = self.tokenizer or tokenizer
        if tokenizer is None:
            raise ValueError(
                "corpus= is tokenized with the model's tokenizer, and this BlockwiseLM has none: load it with "
                "blockdecode.load, set model.tokenizer, or pass indexes from blockdecode.drafters.sources.corpus_index"
            )
        return (*arrays, corpus_index(tokenizer, named))

    def _rows_of(self, out: BlockwiseOutput, mask: torch.Tensor | None) -> list[list[int]]:
        """Each row's prompt (an encoder-decoder's decoder prompt) and new tokens, without padding."""
        new = [stats.new_tokens for stats in out.row_stats]
        width = out.sequences.shape[1] - max(new)
        prompts = row_tokens(out.sequences[:, :width], None if is_seq2seq(self.base) else mask)
        return [p + s[width : width + n] for p, s, n in zip(prompts, out.sequences.tolist(), new)]

    def forget(self) -> None:
        """Empty this model's remembered outputs (what suffix lookup reads with generate's remember)."""
        self.memory.forget()

    def save_pretrained(
        self,
        directory: str | os.PathLike,
        save_base: bool = True,
        training: dict | None = None,
        tokenizer: object | None = None,
    ) -> None:
        """Write the heads (safetensors), their config (JSON), by default the base model, and the
        tokenizer if given; `training` (how the heads were trained, what they reached) is kept in
        the config.

        A save replaces the folder's files as a whole: a reader, or a crash, sees the old save or
        the new one, never the new base with the old heads (`io.saving_folder`)."""
        with saving_folder(Path(directory), HEADS_CONFIG) as staging:
            self.write_save(staging, save_base, training, tokenizer)

    def write_save(
        self, folder: Path, save_base: bool = True, training: dict | None = None, tokenizer: object | None = None
    ) -> None:
        """save_pretrained's files, written into `folder` as they are, blockdecode.json last: for a
        caller that replaces a folder as a whole itself (a training run's final save, with its plot)."""
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.heads.state_dict().items()}
        meta = {"heads": self.config.to_dict(), "base_model": "." if save_base else self.base_location}
        if not save_base:  # so a reload can tell whether that location still holds these weights
            meta["base_signature"] = weights_signature(self.base)
        if training is not None:
            meta["training"] = training
        if self.default_drafters is not None:
            meta["default_drafters"] = self.default_drafters
        if save_base:
            self.base.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        save_file(tensors, str(folder / HEADS_WEIGHTS), metadata={"format": "pt"})
        if self.eagle3 is not None:
            self.eagle3.save(folder / EAGLE3_FOLDER)
        if self.dflash is not None:
            self.dflash.save(folder / DFLASH_FOLDER)
        write_text(folder / HEADS_CONFIG, json.dumps(meta, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        base: PreTrainedModel | None = None,
        k: int | None = None,
        head_type: str | None = None,
        **base_kwargs,
    ) -> BlockwiseLM:
        """The model a folder (or a hub name) holds, read once by `loading.read_model`: a saved BlockwiseLM's
        heads and drafters on `base` or on the base model they name, or a plain `transformers` model with
        untrained `head_type` heads ("paper" by default) for block size k (default 16: the default then drafts by
        suffix lookup, to that depth, `decoding.choice.LOOKUP_DEFAULT`), exact though they rarely
        propose well. A head_type other than the saved heads' is refused, not ignored. The tokenizer and the
        prompts the folder ships (prompts.json) become `model.tokenizer` and `model.prompts`, what corpora are
        tokenized with and `model.plan()` measures on. `base_kwargs` (dtype=...) go to the base's loader."""
        if head_type is not None and head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head_type {head_type!r}: choose one of {', '.join(HEAD_TYPES)}")
        saved = read_model(directory, base, **base_kwargs)
        if saved.heads is None:
            model = cls.from_base(saved.base, k=k or LOOKUP_DEPTH, head_type=head_type or "paper")
            model.base_location = saved.base_location
        else:
            if head_type not in (None, saved.heads.head_type):
                raise ValueError(
                    f"{directory} holds trained {saved.heads.head_type} heads, not head_type={head_type!r}: leave "
                    "head_type out (it chooses the untrained heads a plain transformers model gets)"
                )
            model = cls(saved.base, saved.heads, base_location=saved.base_location)
            model.load_heads(saved.heads_state, saved.heads_file)
        model.default_drafters = saved.default_drafters
        model.priors_folder = str(saved.folder) if saved.heads is not None else None
        if saved.eagle3 is not None:
            model.attach_eagle3(saved.eagle3, saved.eagle3_folder)
        if saved.dflash is not None:
            model.attach_dflash(saved.dflash, saved.dflash_folder)
        model.tokenizer, model.prompts = saved.tokenizer, saved.prompts
        return model

    def load_heads(self, state: dict[str, torch.Tensor], where: Path) -> None:
        """Heads' weights read from `where`, refused in one line unless they fit this model's config."""
        cfg, expected = self.config, self.heads.state_dict()
        if set(state) != set(expected) or any(state[n].shape != expected[n].shape for n in expected):
            raise CheckpointError(
                f"{where} does not match its config (k={cfg.k}, head_type={cfg.head_type}, "
                f"hidden_size={cfg.hidden_size}, head_hidden_size={cfg.head_hidden_size})"
            )
        self.heads.load_state_dict(state)
        self.heads_trained = True
