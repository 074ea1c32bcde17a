"""Blockwise parallel decoding: predict, verify, accept (Stern et al., 2018, §3-4).

One call of the base model verifies a block and, from the same pass, yields the hidden
state the drafter proposes the next block from (the paper's merged scheme), so m tokens
cost about m / k̂ + 1 calls. Acceptance is exact by default, so the output equals greedy
decoding; the paper's relaxed rules (`blockdecode.decoding.acceptance`) are opt-in. Under sampling the
acceptance step is speculative sampling (`blockdecode.decoding.sampling`), so the output has exactly the
distribution of `transformers`' sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from blockdecode.core.hf import dtype_name, eval_mode, is_seq2seq, vocab_size
from blockdecode.core.tree import Tree
from blockdecode.decoding.acceptance import Acceptance
from blockdecode.decoding.adapter import open_decoder
from blockdecode.decoding.costs import remeasured
from blockdecode.decoding.healing import Healing, check_healing
from blockdecode.decoding.inputs import check_attention_mask, check_prompt, row_tokens, token_budget
from blockdecode.decoding.output import BlockwiseOutput, DecodeStats, per_call, ties_note
from blockdecode.decoding.plan import DecodePlan, make_plan, plan_for_rows
from blockdecode.decoding.ranking import OFFERED, Ranker, batch_width
from blockdecode.decoding.reference import near_tie
from blockdecode.decoding.rules import greedy_rules
from blockdecode.decoding.sampling import check_generator, sampling_settings, speculative_sample
from blockdecode.decoding.stopping import StopStrings, first_stop
from blockdecode.drafters.base import Drafter, check_ids, check_paths, check_proposal
from blockdecode.drafters.proposals import Lattice, Scored

COST_CONTEXT = 256  # tokens of the sequence a cost curve measured again mid-decode is timed over


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    plan: DecodePlan,
    on_block: Callable[[list[int]], None] | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    healing: Healing | None = None,
    stop_strings: StopStrings | None = None,
) -> BlockwiseOutput:
    """Greedy decoding of `model` as `plan` says (or sampling, if the plan samples), up to k tokens a
    call for every row of `input_ids` [B, T]: predict, verify, accept.

    `attention_mask` [B, T]: 0 on padding (left padding for a decoder-only model, as `generate` takes
    it). Every row accepts its own block each call and stops at its own EOS or budget; a batch
    verifies one chain a row (a tree asked for is decoded as the first drafter's chain, with a note).
    `on_block`, if given, receives the tokens each call gains (the prefill's one included), in order:
    enough to stream text and to show the accepted blocks (one row only). `generator`: where sampling
    draws its randomness (default: torch's global one), so that a seed gives the same tokens. A model
    in training mode decodes in eval mode, and is put back as it was (`hf.eval_mode`).
    `healing` (`blockdecode.decoding.healing.heal_prompts`, whose own input_ids and attention_mask these are): each
    healed row's new tokens first write its dropped token's text again, as `generate` does with the
    healing's `prefix_allowed_tokens_fn`: the first from the prefill, then one a call until they have.
    `stop_strings`: a row also ends at the token that completes one, as `generate(stop_strings=...)` ends it."""
    prompt = check_prompt(model, input_ids, max_new_tokens, attention_mask)
    max_new_tokens = token_budget(max_new_tokens)
    mask = check_attention_mask(model, prompt, attention_mask)
    check_generator(generator, model.device)
    if healing is not None:
        check_healing(model, healing, prompt, mask)
    if on_block is not None and prompt.shape[0] > 1:
        raise ValueError(f"on_block streams one sequence; input_ids has {prompt.shape[0]} rows: decode them without it")
    plan = plan_for_rows(plan, prompt.shape[0])
    room = max_new_tokens + max(plan.tree or 0, plan.k)
    with eval_mode(model):  # a model in training mode would decode with dropout, not greedy's output
        base, start = open_decoder(model, prompt, plan.cache_implementation, room, mask)
        padding = None if is_seq2seq(model) else mask  # the decoder's: an encoder-decoder's start tokens have none
        run = Run(model, plan, start, padding, max_new_tokens, on_block, healing)
        base.read_layers, run.stop_strings = run.read_layers, stop_strings
        logits, h = base.prefill(start, padding)
        run.feed(base, [list(range(start.shape[1])) if padding is None else padding[i].nonzero().view(-1).tolist()
                        for i in range(len(run.active))])  # fmt: skip
        for i, row in enumerate(run.active):
            scores = run.rules.apply(logits[i, -1:].float(), run.rule_length(row), allowed=run.allowed(row))
            first = accept(plan, Tree(), scores, generator)
            run.gain(row, first.gained, [0], top2=first.top2)
        newest, h_last = run.newest(), h[:, -1].clone()  # not a view a drafter can write to
        newest, h_last = run.drop_finished(base, newest, h_last)
        while run.active:
            allowed = [run.allowed(row) for row in run.active]  # None but where healing constrains the next token
            depth = min(plan.k - 1, min(run.left(row) for row in run.active) - 1)  # never past any row's budget
            depth = 0 if any(a is not None for a in allowed) else depth  # what may follow hangs on that token
            candidates = predict(plan, run, h_last, depth)
            began = time.perf_counter()
            scores, h = verify(base, run, newest, candidates, allowed)
            accepted = [accept(plan, c, s, generator) for c, s in zip(candidates, scores)]
            if run.rankers:  # what stood teaches each row's ranking
                for row, a in zip(run.active, accepted):
                    ranker, chances = run.rankers[row], None if a.chances is None else a.chances.tolist()
                    ranker.observe(a.path, chances, a.stood, a.gained)
                    while ranker.news:
                        run.say(row, ranker.news.pop(0))
                run.clock(model, len(candidates[0]) + 1, time.perf_counter() - began)
            run.feed(base, [a.path for a in accepted])
            base.keep_paths([a.path for a in accepted])  # each row: the newest token and its accepted path
            for row, c, a in zip(run.active, candidates, accepted):
                owners = [c.owners[i - 1] for i in a.path[1:]]
                run.gain(row, a.gained, a.path, verified=len(c) + 1, owners=owners, top2=a.top2)
            last = [a.path[-1] for a in accepted]
            newest = torch.stack([a.after for a in accepted]).view(-1, 1)
            h_last = h[torch.arange(len(last)), last]
            newest, h_last = run.drop_finished(base, newest, h_last)
        return run.output(base)


def predict(plan: DecodePlan, run: Run, hidden: torch.Tensor, depth: int) -> list[Tree]:
    """The candidates this call verifies for each row still decoding: the first drafter's chain (all
    rows in one call), or (one row) every drafter's paths merged into one tree of at most `plan.tree`
    nodes, in the drafters' order."""
    tokens = [run.seq[row : row + 1, : run.length(row)] for row in run.active]
    trees = [Tree() for _ in tokens]
    if depth == 0:
        return trees
    if run.rankers and len(run.tokens) > 1:  # a batch, even down to one row: each row's likeliest chain, one width
        rankers = [run.rankers[row] for row in run.active]
        offered = [drafter.rows_scored(tokens, hidden, depth, run.active) for drafter in plan.drafters]
        chains = [
            ranker.best_chain([clip(rows[i], depth, run.vocab) for rows in offered], depth)
            for i, ranker in enumerate(rankers)
        ]
        width = batch_width(rankers, chains, depth)
        return [ranker.take(chain, width) for ranker, chain in zip(rankers, chains)]
    if run.rankers:  # one row: every candidate ranked by its chance to stand, the size chosen by cost
        ranker = run.rankers[run.active[0]]
        chain, cap = plan.tree is None, plan.tree or depth  # a chain: the drafter's expected to gain the most
        if ranker.fallen_to is not None:  # this sequence gained more a second from one part alone
            return [alone(ranker, plan, tokens[0], hidden, depth, run.vocab)]
        found: list[Scored | Lattice] = []
        offered: dict[str, list[Scored | Lattice]] = {}
        spent: dict[str, float] = {}
        began = time.perf_counter()
        for drafter in plan.drafters:  # cheapest first; a costly one only where its guesses pay for its time
            have = [ranker.best_chain(found, cap)] if chain and found else found
            own = drafter.depth_for(depth)  # the heads: their k-1 at most
            # under sampling a drafter is weighed by its cached time alone (`Ranking.drafting`): a seed repeats
            if found and not ranker.worth_asking(drafter.name, have, own, cap):
                continue
            start = time.perf_counter()
            if chain:
                made = [drafter.chain_scored(tokens[0], hidden, own)]
            else:
                reach = ranker.reach(drafter.name, own)  # no deeper than its trees lately went, and one more
                made = drafter.propose_scored(tokens[0], hidden, reach, min(plan.tree, OFFERED))
            spent[drafter.name] = time.perf_counter() - start
            ranker.timed(drafter.name, spent[drafter.name])
            offered[drafter.name] = [clip(s, depth, run.vocab) for s in made]
            found += offered[drafter.name]
        tree = ranker.tree([ranker.best_chain(found, cap)] if chain else found, cap)
        if not chain and len(plan.drafters) > 1:  # a tree of several drafters is judged against its cheapest alone
            ranking = time.perf_counter() - began - sum(spent.values())
            ranker.compare_parts(offered, spent, len(tree), plan.drafters[0].name, ranking)
        return [tree]
    if plan.tree is None:
        chains = check_proposal(plan.drafters[0].propose_rows(tokens, hidden, depth, run.active), depth, len(tokens))
        for tree, chain in zip(trees, chains):
            tree.add_path(check_ids(chain, run.vocab), depth, depth, plan.drafters[0].name)
        return trees
    candidates = trees[0]
    for drafter in plan.drafters:
        if len(candidates) >= plan.tree:
            break
        paths = drafter.propose_paths(tokens[0], hidden, depth, plan.tree - len(candidates))
        for path in check_paths(paths, depth, run.vocab):
            candidates.add_path(path, plan.tree, depth, drafter.name)
    return trees


def alone(
    ranker: Ranker, plan: DecodePlan, tokens: torch.LongTensor, hidden: torch.Tensor, depth: int, vocab: int
) -> Tree:
    """This call's candidates from the part a sequence fell back to (`Ranker.fallen_to`): its chain, or a tree
    ranked from its candidates alone."""
    part = ranker.fallen_to
    drafter = next(d for d in plan.drafters if d.name == part.drafter)
    depth = drafter.depth_for(depth)
    start = time.perf_counter()
    if part.tree:
        found = drafter.propose_scored(tokens, hidden, ranker.reach(drafter.name, depth), min(plan.tree, OFFERED))
        tree = ranker.tree([clip(s, depth, vocab) for s in found], plan.tree)
    else:
        tree = ranker.take(clip(drafter.chain_scored(tokens, hidden, depth), depth, vocab), depth)
    ranker.alone(len(tree), time.perf_counter() - start)
    return tree


def clip(scored: Scored | Lattice, depth: int, vocab: int) -> Scored | Lattice:
    """A drafter's path, or lattice, no deeper than this call's `depth`, its ids checked."""
    scored.sources = scored.sources[:depth]
    if isinstance(scored, Lattice):
        scored.aside = scored.aside[:depth]
        scored.tokens = [check_ids(t, vocab) for t in scored.tokens[:depth]]
    else:
        scored.tokens = check_ids(scored.tokens[:depth], vocab)
    return scored


def verify(
    base, run: Run, newest: torch.LongTensor, candidates: list[Tree], allowed: list[list[int] | None]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One forward over each row's newest token and its candidates, each seeing its row's context and
    its own ancestors (chains: plain causal attention, the fast path); each row's scores after the
    generation config's rules at each, and `allowed`'s ids alone for the row's next token where given
    (what greedy takes the argmax of, and sampling warps), and the decoder outputs."""
    ids = torch.cat([newest, newest.new_tensor([c.tokens for c in candidates])], dim=1)
    if all(c.is_chain() for c in candidates):
        logits, h = base.score(ids)
    else:  # one row: the tree
        (tree,) = candidates
        depths = torch.tensor([0, *tree.depths], device=ids.device)
        logits, h = base.score(ids, positions=depths + run.length(run.active[0]) - 1, mask=tree.ancestry())
    scores = [
        run.rules.apply(logits[i].float(), run.rule_length(row), [0, *c.depths], allowed[i])
        for i, (row, c) in enumerate(zip(run.active, candidates))
    ]
    return scores, h


class Accepted(NamedTuple):
    """What a call accepted for one row."""

    path: list[int]  # the deepest path of candidates that stands, as node indices from the newest token (0)
    gained: list[int]  # its tokens, ending with the model's own token after the path
    after: torch.Tensor  # the model's token after the path (0-dim, on the device): the next call's newest
    chances: torch.Tensor | None  # under sampling, each candidate's chance to stand if its parent does
    stood: list[int]  # every node that stands with its whole path: the path's, and siblings a relaxed rule keeps
    top2: torch.Tensor | None  # exact greedy: the two best scores [len(path), 2] where each gained token was chosen


def accept(
    plan: DecodePlan, candidates: Tree, scores: torch.Tensor, generator: torch.Generator | None = None
) -> Accepted:
    """What stands of `candidates`. Greedy: a candidate stands when the rule agrees with its parent's
    scores, and the model's token is the argmax. Sampling (a chain): speculative sampling, and the
    model's token a draw; a candidate's chance to stand is p(x) at its parent, as a drafter's guess is
    certain (q(x) = 1), so a ranking learns the expected outcome rather than one draw. One host sync a
    call; exact greedy keeps, on the device, the two best scores at the path's nodes, where its tokens
    were chosen (`Run.near_ties` reads them once a decode)."""
    ids = torch.tensor(candidates.tokens, dtype=torch.long, device=scores.device)
    chances = None
    if plan.sampling is None:
        after = scores.argmax(-1)  # [m+1]
        parents = torch.tensor([*candidates.parents, 0], device=scores.device)  # one row more, as agree() takes
        parent_scores = None if plan.acceptance.rule == "exact" else scores[parents]  # exact compares ids alone
        right = plan.acceptance.agree(ids, parent_scores, after[parents])
    else:
        probs = plan.sampling.probs(scores)
        right, after = speculative_sample(probs, ids, None, generator)  # a drafter's guess is certain
        chances = probs[torch.tensor(candidates.parents, dtype=torch.long, device=scores.device), ids]
    host = torch.cat([right.long(), after.view(-1)]).tolist()
    m = len(candidates)
    path = candidates.accepted_path(host[:m])
    stood = [i for i, ok in enumerate(candidates.standing(host[:m])) if ok]
    top2 = None
    if plan.sampling is None and plan.acceptance.rule == "exact":  # the rows each gained token is the argmax of
        rows = scores[: len(path)] if path[-1] == len(path) - 1 else scores[path]  # a prefix (a chain's): a view
        top2 = rows.topk(2, dim=-1).values
    last = path[-1] if plan.sampling is None else 0  # sampling drew only the token after the path
    gained = [candidates.tokens[i - 1] for i in path[1:]] + [host[m + last]]
    return Accepted(path, gained, after.view(-1)[last], chances, stood, top2)


class Run:
    """The sequences one decode builds, a row each, and what they cost. The drafters read `seq` on the
    device (each row's tokens from the left, without padding); the output is built from `tokens`,
    which only the loop writes, so a drafter that scribbles on what it is shown cannot change the
    result. `active`: the rows still decoding, in the order the adapter holds them."""

    stop_strings: StopStrings | None = None  # where a row also ends (`decode` sets it)

    def __init__(self, model, plan: DecodePlan, start: torch.LongTensor, mask, max_new_tokens: int, on_block, healing):
        self.plan, self.on_block, self.start, self.healing = plan, on_block, start, healing
        self.prompt_len = start.shape[1]  # padding included: the length `generate`'s rules count
        self.max_new_tokens = max_new_tokens
        self.rules = greedy_rules(model, self.prompt_len, max_new_tokens, set(plan.eos))
        self.vocab = vocab_size(model)
        self.pad = pad_token(model, plan.eos)
        rows = row_tokens(start, mask)
        self.tokens: list[list[int]] = rows
        self.new = [0] * len(rows)
        self.seq = start.new_zeros((len(rows), self.prompt_len + max_new_tokens))
        for row, tokens in enumerate(rows):
            self.seq[row, : len(tokens)] = start.new_tensor(tokens)
        sampling = plan.sampling.spec if plan.sampling else ""
        self.stats = [DecodeStats(acceptance=plan.acceptance.spec, sampling=sampling, note=plan.note) for _ in rows]
        self.dtype = model.dtype  # what near ties are judged by
        self.decided: list[list[tuple[int, torch.Tensor]]] = [[] for _ in rows]  # (position, top two scores)
        self.active = list(range(len(rows)))
        self.done = [False] * len(rows)
        self.begun = time.perf_counter()
        for drafter in plan.drafters:
            drafter.start(self.tokens)
        self.readers = [d for d in plan.drafters if d.layers]  # drafters that read the base's layers
        self.read_layers = self.readers[0].layers if self.readers else ()
        if any(d.layers != self.read_layers for d in self.readers):
            raise ValueError("drafters that read different layers of the base cannot share a decode")
        self.rankers = [plan.ranking.start() for _ in rows] if plan.ranking is not None else []

    def feed(self, base, paths: list[list[int]]) -> None:
        """Hand the drafters that read the base's layers their features at the positions each active row
        keeps of the last forward (`paths`: its indices there), in order."""
        if not self.readers:
            return
        for i, (row, path) in enumerate(zip(self.active, paths)):
            features = base.features[i, path]
            for drafter in self.readers:
                drafter.see(row, features)

    def clock(self, model: PreTrainedModel, q: int, seconds: float) -> None:
        """One sequence's call verified `q` tokens in `seconds`: where its ranking checks the machine's cost curve
        (`Ranker.clock`) and these calls disprove it, it is measured again (once a process; then scaled to the calls:
        `costs.remeasured`) and is what this decode and later ones rank with."""
        if len(self.rankers) != 1:
            return
        ranker = self.rankers[0]
        off = ranker.clock(q, seconds)
        if off is None:
            return
        n = self.length(0)
        context = self.seq[:1, max(0, n - COST_CONTEXT) : n]
        curve = remeasured(model, context, self.plan.cache_implementation, ranker.clocked, off, dict(ranker.points))
        ranker.recost(curve)
        self.plan.ranking.learnt["cost"] = tuple(sorted(curve.items()))
        self.say(0, f"the cost curve was measured again: calls took {off:.2g}x what it said")

    def say(self, row: int, note: str) -> None:
        """Add `note` to row `row`'s stats: where its decode went otherwise than planned."""
        self.stats[row].note = "; ".join(filter(None, [self.stats[row].note, note]))

    def length(self, row: int) -> int:  # the row's tokens decoded so far; the cache holds all but the newest
        return len(self.tokens[row])

    def rule_length(self, row: int) -> int:
        """The row's length as `generate`'s rules count it: with the batch's padding."""
        return self.prompt_len + self.new[row]

    def allowed(self, row: int) -> list[int] | None:
        """The ids the row's next token may take while healing writes its dropped token again; None: any."""
        if self.healing is None:
            return None
        return self.healing.allowed(row, self.tokens[row][self.length(row) - self.new[row] :])

    def left(self, row: int) -> int:
        """New tokens the row may still gain."""
        return self.max_new_tokens - self.new[row]

    def gain(
        self,
        row: int,
        gained: list[int],
        path: list[int],
        verified: int = 0,
        owners: Sequence[str] = (),
        top2: torch.Tensor | None = None,
    ) -> None:
        """Append what a call gained for `row`, up to and including an EOS or a stop string's end (generate stops);
        `owners`: the drafter that proposed each accepted node of `path`; `top2`: the two best scores
        where each token was chosen, kept on the device for `near_ties`."""
        stop = first_stop(gained, self.plan.eos, self.tokens[row], self.stop_strings)
        if stop is not None:
            gained, self.done[row] = gained[: stop + 1], True
        if top2 is not None:
            self.decided[row].append((self.prompt_len + self.new[row], top2[: len(gained)]))
        n = self.length(row)
        self.seq[row, n : n + len(gained)] = torch.tensor(gained)
        self.tokens[row] += gained
        self.new[row] += len(gained)
        self.done[row] = self.done[row] or self.new[row] >= self.max_new_tokens
        if verified:  # not the prefill's token
            stats = self.stats[row]
            stats.block_sizes.append(len(gained))
            stats.verified.append(verified)
            stats.accepted_nodes.append(path[1:])
            for owner in owners[: len(gained)]:  # proposals kept before an EOS
                stats.supplied[owner] = stats.supplied.get(owner, 0) + 1
        for drafter in self.plan.drafters:
            drafter.observe(row, gained)
        if self.on_block is not None:
            self.on_block(gained)

    def newest(self) -> torch.LongTensor:
        """[N, 1]: each active row's newest token."""
        return self.start.new_tensor([[self.tokens[row][-1]] for row in self.active])

    def drop_finished(self, base, newest: torch.Tensor, h_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stop decoding the rows that are done: out of the batch, the cache and the next call's inputs."""
        keep = [i for i, row in enumerate(self.active) if not self.done[row]]
        if len(keep) < len(self.active) and keep:
            base.select_rows(keep)
        self.active = [self.active[i] for i in keep]
        return newest[keep], h_last[keep]

    def near_ties(self) -> None:
        """Each row's near ties, from the two best scores at every position decided, read from the device
        once a decode (no sync a call), and said in its note."""
        found = [(row, at + j) for row, kept in enumerate(self.decided) for at, top2 in kept for j in range(len(top2))]
        if not found:
            return
        scores = torch.cat([top2 for kept in self.decided for _, top2 in kept]).tolist()
        for (row, position), (best, second) in zip(found, scores):
            if near_tie(best - second, best, self.dtype):
                self.stats[row].near_ties.append((position, best - second))
        for stats in self.stats:
            stats.note = "; ".join(filter(None, [stats.note, ties_note(stats.near_ties, self.dtype)]))

    def output(self, base) -> BlockwiseOutput:
        seconds = time.perf_counter() - self.begun
        if len(self.rankers) == 1:  # one sequence's lesson (a batch asks every drafter: nothing to carry)
            self.plan.ranking.keep(self.rankers[0])
        self.near_ties()
        for stats in self.stats:
            stats.calls, stats.encoder_calls = 1 + len(stats.block_sizes), base.encoder_calls
            stats.seconds = seconds
        for stats, new in zip(self.stats, self.new):
            stats.new_tokens = new
        width = self.prompt_len + max(self.new)
        sequences = self.start.new_full((len(self.tokens), width), self.pad)
        sequences[:, : self.prompt_len] = self.start
        for row, tokens in enumerate(self.tokens):
            sequences[row, self.prompt_len : self.prompt_len + self.new[row]] = self.seq.new_tensor(
                tokens[-self.new[row] :]
            )
        if len(self.stats) == 1:
            total = self.stats[0]
        else:
            first = self.stats[0]
            tied = ", ".join(str(row) for row, stats in enumerate(self.stats) if stats.near_ties)
            ties = f"near ties ({dtype_name(self.dtype)}) in rows {tied}, each in its row_stats" if tied else ""
            note = "; ".join(filter(None, [self.plan.note, ties]))
            total = DecodeStats(acceptance=first.acceptance, sampling=first.sampling, note=note)
            total.block_sizes, total.verified = (
                per_call(s.block_sizes for s in self.stats),
                per_call(s.verified for s in self.stats),
            )
            total.new_tokens, total.seconds = sum(self.new), seconds
            total.supplied = DecodeStats.pooled(self.stats).supplied
        total.calls, total.encoder_calls = base.calls, base.encoder_calls
        return BlockwiseOutput(sequences=sequences, stats=total, row_stats=self.stats)


def pad_token(model: PreTrainedModel, eos: frozenset[int]) -> int:
    """What `generate` pads finished rows with: the generation config's pad_token_id, else the first EOS
    id in the order the generation config lists them (else the lowest of `eos`), else 0 (then no row
    ends early)."""
    cfg = model.generation_config
    if cfg.pad_token_id is not None:
        return int(cfg.pad_token_id)
    listed = cfg.eos_token_id if isinstance(cfg.eos_token_id, list | tuple) else [cfg.eos_token_id]
    return next((int(t) for t in listed if t in eos), min(eos, default=0))


def blockwise_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    drafter: Drafter | Sequence[Drafter] | str,
    k: int,
    eos_token_id: int | Sequence[int] | None = None,
    cache_implementation: str = "dynamic",
    on_block: Callable[[list[int]], None] | None = None,
    acceptance: str | Acceptance | None = None,
    tree: int | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
) -> BlockwiseOutput:
    """Greedy decoding of any `transformers` model with proposals from `drafter` (a Drafter, a list of
    them sharing a tree, or "ngram"): the plan made from these settings (`blockdecode.decoding.plan.make_plan`),
    then decoded. `tree=None` verifies one chain of k-1 proposals a call, `tree=N` a tree of up to N
    candidates. `acceptance` other than exact (the default) is faster and no longer greedy's output.
    `do_sample=True` samples as `model.generate(do_sample=True, temperature, top_k, top_p)` does (see
    `BlockwiseLM.generate`), drawing from `generator`. `input_ids` [B, T] with `attention_mask` decodes
    a batch, as `decode` says."""
    check_prompt(model, input_ids, max_new_tokens, attention_mask)  # a bad prompt fails before any planning
    check_generator(generator, model.device)
    sampling = sampling_settings(model, do_sample, temperature, top_k, top_p)
    plan = make_plan(model, drafter, k, tree, acceptance, eos_token_id, cache_implementation, sampling=sampling)
    return decode(model, input_ids, max_new_tokens, plan, on_block, generator, attention_mask)


def decode_prompts(
    model: PreTrainedModel, prompts: Iterable[torch.LongTensor], max_new_tokens: int, plan: DecodePlan
) -> tuple[list[BlockwiseOutput], DecodeStats]:
    """Decode each prompt as `plan` says; each output, and their stats pooled (every call's block size)."""
    outs = [decode(model, ids, max_new_tokens, plan) for ids in prompts]
    return outs, DecodeStats.pooled(o.stats for o in outs)
