"""Chat as `transformers` users run it: generate's eos lists, stop strings, streamers and pad token, the chat
helper, `generate --chat`, and `blockdecode chat` driven in a terminal, on tiny random Qwen2 and Llama chat models
(ChatML template, EOS [<|im_end|>, <|endoftext|>]), each output checked against `transformers`' own."""

from __future__ import annotations

import codecs
import os
import re
import select
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, TextStreamer

from blockdecode import BlockwiseLM, ScriptedDrafter, load
from blockdecode.chat import BlockStreamer, chat_ids
from blockdecode.cli import main
from blockdecode.core.toy import toy_model
from blockdecode.decoding.healing import heal_prompts
from blockdecode.pretraining.corpus import train_tokenizer

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FIRST = [{"role": "user", "content": "Hello, how are you?"}]
SECOND = {"role": "user", "content": "What is the cat?"}
SYSTEM = {"role": "system", "content": "Be brief."}
BUDGET = 40


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE over ASCII text alone (no byte tokens that could end mid-character, so any reply is text),
    with ChatML's special tokens and template. Its code lines teach it "\\n   " tokens, so that a prompt ending in
    the template's "\\n" ends mid-token, as a real chat prompt does."""
    lines = [f"The {a} is {b}. Hello, how are you? I am fine, thank you." for a in ("cat", "dog", "sky") for b in
             ("red", "blue")] + [f"def f{i}(x):\n    return x + {i}\n" for i in range(20)]  # fmt: skip
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=list(SPECIAL),
                                                            show_progress=False))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])  # fmt: skip
    tok.chat_template = CHATML
    return tok


def greedy(model, ids: torch.LongTensor, max_new_tokens: int = BUDGET, **kwargs) -> torch.LongTensor:
    with torch.inference_mode():
        mask = kwargs.pop("attention_mask", torch.ones_like(ids))
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


def chat_model(arch: str, tok: PreTrainedTokenizerFast):
    """A random `arch` chat model whose turns end: <|im_end|>'s output row is a copy, scaled up a little, of a
    token greedy writes some way into the first reply, so that the first reply ends there."""
    model = toy_model(arch, vocab=len(tok), context=512)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.pad_token_id, cfg.eos_token_id = eot, eot, im_end
    model.generation_config.eos_token_id = [im_end, eot]  # as Qwen's generation config lists them
    ids = chat_ids(tok, FIRST)
    new = greedy(model, ids, eos_token_id=[])[0, ids.shape[1] :].tolist()
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        for token in new[8:]:
            weight[im_end] = 1.05 * weight[token]
            if 8 <= greedy(model, ids).shape[1] - ids.shape[1] < BUDGET:
                return model
    raise AssertionError(f"no token of {arch}'s first reply ends its turn early")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def chat(request, tmp_path_factory) -> SimpleNamespace:
    """A saved plain transformers chat model (as a GGUF instruct model loads) and its BlockwiseLM from `load`."""
    tok = chat_tokenizer()
    folder = tmp_path_factory.mktemp(f"chat-{request.param}")
    chat_model(request.param, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    lm, tok = load(folder)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return SimpleNamespace(dir=folder, lm=lm, tok=tok, im_end=im_end, eot=eot, ids=chat_ids(tok, FIRST))


def new_tokens(seq: torch.LongTensor, ids: torch.LongTensor) -> list[int]:
    return seq[0, ids.shape[1] :].tolist()


def test_generate_stops_at_the_generation_configs_eos_list(chat) -> None:
    ref = greedy(chat.lm.base, chat.ids)
    assert ref[0, -1] == chat.im_end and ref.shape[1] - chat.ids.shape[1] < BUDGET  # the turn ends early
    for drafter in ("auto", "ngram"):
        out = chat.lm.generate(chat.ids, BUDGET, drafter=drafter)
        assert out.sequences.tolist() == ref.tolist(), drafter


def test_eos_token_id_as_an_int_or_a_list(chat) -> None:
    full = new_tokens(greedy(chat.lm.base, chat.ids, eos_token_id=[]), chat.ids)
    early = full[4]  # a token greedy writes early: as an EOS id, the decode ends at its first occurrence
    for eos in (early, [chat.eot, early], [chat.im_end, chat.eot]):
        ref = greedy(chat.lm.base, chat.ids, eos_token_id=eos)
        out = chat.lm.generate(chat.ids, BUDGET, eos_token_id=eos)
        assert out.sequences.tolist() == ref.tolist(), eos
    assert len(new_tokens(out.sequences, chat.ids)) < BUDGET


def test_stop_strings_stop_where_transformers_stops(chat) -> None:
    """A stop string that starts and ends inside tokens, met inside an accepted block (the drafter proposes greedy's
    own continuation, so whole blocks stand): the output keeps the token that completes it, as generate does."""
    full = greedy(chat.lm.base, chat.ids, eos_token_id=[])
    text = chat.tok.decode(new_tokens(full, chat.ids)[3:7])
    stop = text[1:-1].strip() or text
    ref = greedy(chat.lm.base, chat.ids, stop_strings=[stop, "never written"], tokenizer=chat.tok, eos_token_id=[])
    assert stop in chat.tok.decode(new_tokens(ref, chat.ids)) and ref.shape[1] < full.shape[1]
    scripted = ScriptedDrafter(full, len(chat.tok))
    for kwargs in (dict(drafter=scripted, k=8), dict(drafter="ngram", tree=None), {}):
        out = chat.lm.generate(chat.ids, BUDGET, stop_strings=[stop, "never written"], tokenizer=chat.tok,
                               eos_token_id=[], **kwargs)  # fmt: skip
        assert out.sequences.tolist() == ref.tolist(), kwargs
    out = chat.lm.generate(chat.ids, BUDGET, drafter=scripted, k=8, stop_strings=stop, eos_token_id=[])  # str
    assert out.sequences.tolist() == ref.tolist() and max(out.stats.block_sizes) > 1  # model.tokenizer by default


def test_the_generation_configs_stop_strings_apply_by_default(chat) -> None:
    full = greedy(chat.lm.base, chat.ids, eos_token_id=[])
    stop = chat.tok.decode(new_tokens(full, chat.ids)[5:7])
    config = chat.lm.base.generation_config
    config.stop_strings = [stop]
    try:
        ref = greedy(chat.lm.base, chat.ids, tokenizer=chat.tok, eos_token_id=[])
        assert chat.lm.generate(chat.ids, BUDGET, eos_token_id=[]).sequences.tolist() == ref.tolist()
    finally:
        config.stop_strings = None
    assert ref.shape[1] < full.shape[1]


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value)

    def end(self) -> None:
        self.ends += 1


def whole_blocks(chat) -> dict:
    """Settings under which every block stands whole: a drafter that proposes greedy's own reply, 4 tokens a call."""
    return dict(drafter=ScriptedDrafter(greedy(chat.lm.base, chat.ids), len(chat.tok)), k=4)


def test_a_streamer_gets_the_prompt_then_each_block_as_it_stands(chat) -> None:
    recorder = Recorder()
    out = chat.lm.generate(chat.ids, BUDGET, streamer=recorder, **whole_blocks(chat))
    assert torch.equal(recorder.puts[0], chat.ids) and recorder.ends == 1
    assert [len(p) for p in recorder.puts[1:]] == [1, *out.stats.block_sizes]  # the prefill's token, then each call
    assert max(out.stats.block_sizes) == 4
    assert torch.cat(recorder.puts[1:]).tolist() == new_tokens(out.sequences, chat.ids)


def test_text_streamers_stream_the_decoded_output(chat, capsys: pytest.CaptureFixture) -> None:
    out = chat.lm.generate(chat.ids, BUDGET, streamer=TextStreamer(chat.tok, skip_prompt=True), **whole_blocks(chat))
    printed = capsys.readouterr().out
    greedy(chat.lm.base, chat.ids, streamer=TextStreamer(chat.tok, skip_prompt=True))
    assert printed == chat.tok.decode(new_tokens(out.sequences, chat.ids)) + "\n" == capsys.readouterr().out

    streamer = TextIteratorStreamer(chat.tok, skip_prompt=True, skip_special_tokens=True)
    done = {}
    decoding = dict(streamer=streamer, **whole_blocks(chat))
    thread = threading.Thread(target=lambda: done.update(out=chat.lm.generate(chat.ids, BUDGET, **decoding)))
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    assert streamed == chat.tok.decode(new_tokens(done["out"].sequences, chat.ids), skip_special_tokens=True)
    assert done["out"].sequences.tolist() == out.sequences.tolist()


def test_pad_token_id_pads_a_batchs_finished_rows(chat) -> None:
    tok = chat.tok
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (FIRST, [SECOND])]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    pad = 5
    ref = greedy(chat.lm.base, batch.input_ids, attention_mask=batch.attention_mask, pad_token_id=pad)
    out = chat.lm.generate(batch.input_ids, BUDGET, attention_mask=batch.attention_mask, pad_token_id=pad)
    assert out.sequences.tolist() == ref.tolist()
    assert len({s.new_tokens for s in out.row_stats}) == 2 and (out.sequences[:, -1] == pad).any()  # one row padded


def test_other_generate_keywords_are_named_in_a_warning_and_unknown_ones_are_type_errors(chat) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = chat.lm.generate(chat.ids, 6, num_beams=1, output_scores=True, max_length=99)
    said = [str(w.message) for w in caught]
    assert said == [f"{name} is ignored: blockdecode does not take this keyword of transformers' generate"
                    for name in ("num_beams=1", "output_scores=True", "max_length=99")]  # fmt: skip
    assert out.stats.new_tokens == 6
    with pytest.raises(TypeError, match=r"^BlockwiseLM\.generate\(\) got an unexpected keyword argument 'beams'$"):
        chat.lm.generate(chat.ids, 6, beams=2)
    with pytest.raises(TypeError, match="streamer takes a transformers streamer"):
        chat.lm.generate(chat.ids, 6, streamer=print)
    batch = chat.ids.repeat(2, 1)
    with pytest.raises(ValueError, match="a streamer shows one sequence; input_ids has 2 rows"):
        chat.lm.generate(batch, 6, attention_mask=torch.ones_like(batch), streamer=Recorder())


def test_stop_strings_need_a_tokenizer() -> None:
    lm = BlockwiseLM.from_base(toy_model("llama", vocab=64), k=4)
    with pytest.raises(ValueError, match=r"stop_strings are matched on the model's text: pass its tokenizer"):
        lm.generate(torch.tensor([[5, 6, 7]]), 4, stop_strings=["x"])


def test_chat_replies_as_transformers_does_over_two_turns(chat) -> None:
    messages = list(FIRST)
    for _ in range(2):
        reply = chat.lm.chat(messages, max_new_tokens=BUDGET)
        ids = chat_ids(chat.tok, messages)
        ref = greedy(chat.lm.base, ids)
        assert reply.output.sequences.tolist() == ref.tolist()
        new = new_tokens(ref, ids)
        assert reply.reply == chat.tok.decode(new[:-1] if new[-1] == chat.im_end else new, skip_special_tokens=True)
        assert "<|im_end|>" not in reply.reply and reply.stats.new_tokens == len(new)
        messages += [{"role": "assistant", "content": reply.reply}, SECOND]  # the earlier turns are in the prompt
    streamed: list[str] = []
    again = chat.lm.chat(FIRST, chat.tok, BUDGET, drafter="ngram", streamer=BlockStreamer(chat.tok, streamed.append))
    assert "".join(streamed) == again.reply == chat.lm.chat(FIRST).reply


def test_chat_is_never_healed_and_refuses_what_it_cannot_do(chat) -> None:
    assert heal_prompts(chat.tok, chat.ids).healed  # the template's "\n" ends mid-token here, as in real chats
    with pytest.raises(ValueError, match="a chat prompt is never healed"):
        chat.lm.chat(FIRST, heal=chat.tok)
    with pytest.raises(TypeError, match="messages takes a list of"):
        chat.lm.chat("hello")
    with pytest.raises(ValueError, match="has no chat template"):
        chat.lm.chat(FIRST, train_tokenizer(["abc abd"], vocab_size=270))


def test_block_streamer_holds_back_an_unfinished_character() -> None:
    tok = train_tokenizer(["plain ascii text"], vocab_size=270)
    e_acute = tok("é", add_special_tokens=False).input_ids
    assert len(e_acute) == 2  # two byte tokens
    shown: list[str] = []
    streamer = BlockStreamer(tok, shown.append)
    streamer.put(torch.tensor([[7, 8]]))  # the prompt: not shown
    streamer.put(torch.tensor([e_acute[0]]))
    assert shown == []
    streamer.put(torch.tensor(e_acute[1:] + tok("ok", add_special_tokens=False).input_ids))
    streamer.end()
    assert "".join(shown) == "éok"


def test_generate_chat_sends_one_message_through_the_template_unhealed(chat, capsys: pytest.CaptureFixture) -> None:
    main(["generate", "--model", str(chat.dir), "--chat", FIRST[0]["content"], "--max-new-tokens", str(BUDGET),
          "--compare", "--dtype", "fp32"])  # fmt: skip
    out, err = capsys.readouterr()
    assert out == chat.lm.chat(FIRST, max_new_tokens=BUDGET).reply + "\n"
    assert "identical: yes" in err and "heal" not in err  # a healed reference would have said so

    main(["generate", "--model", str(chat.dir), "--chat", FIRST[0]["content"], "--system", SYSTEM["content"],
          "--max-new-tokens", "12", "--dtype", "fp32"])  # fmt: skip
    assert capsys.readouterr().out == chat.lm.chat([SYSTEM, *FIRST], max_new_tokens=12).reply + "\n"
    with pytest.raises(SystemExit, match="--system is the system message of a --chat message"):
        main(["generate", "--model", str(chat.dir), "--prompt", "x", "--system", "Be brief."])


ESCAPES = r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]"  # a terminal's control sequences (readline's modes, ...)


class Terminal:
    """The far side of a pseudo-terminal, read as a person reads the screen (escape sequences dropped, the
    terminal's \\r\\n read as \\n)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.text, self.seen = fd, "", 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def expect(self, pattern: str, timeout: float = 60) -> str:
        """The screen's text from what was last expected up to `pattern`'s end (waiting for it to appear)."""
        deadline = time.monotonic() + timeout
        while (found := re.search(pattern, self.text[self.seen :])) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} on the screen: {self.text[self.seen :]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the program closed the terminal
                    chunk = b""
                assert chunk, f"the program ended before {pattern!r}: {self.text[self.seen :]!r}"
                self.text += re.sub(ESCAPES, "", self.utf8.decode(chunk)).replace("\r\n", "\n")
        shown, self.seen = self.text[self.seen : self.seen + found.end()], self.seen + found.end()
        return shown


def test_chat_in_a_terminal_as_a_person_uses_it(chat) -> None:
    """`blockdecode chat` in a pseudo-terminal: two turns, each reply streamed and followed by its status line,
    /reset, the first message again (answered as at first: the conversation started over), and Ctrl-D."""
    import pty

    asked = [SYSTEM, *FIRST]
    first = chat.lm.chat(asked, max_new_tokens=24).reply
    replies = [first, chat.lm.chat([*asked, {"role": "assistant", "content": first}, SECOND], max_new_tokens=24).reply]
    controller, child = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
    cmd = [sys.executable, "-m", "blockdecode.cli", "--threads", "1", "chat", "--model", str(chat.dir),
           "--max-new-tokens", "24", "--dtype", "fp32", "--system", SYSTEM["content"]]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=child, stdout=child, stderr=child, env=env, start_new_session=True)
    os.close(child)
    screen = Terminal(controller)
    status = r"\[\d+ tokens, [\d.]+ tokens/s, [\d.]+ tokens a call(, cut at --max-new-tokens)?\]\n"
    try:
        assert "/reset starts a new conversation, Ctrl-D quits" in screen.expect("> ")
        for message, reply in zip([FIRST[0]["content"], SECOND["content"]], replies):
            screen.type(message + "\r")
            shown = screen.expect(status)
            assert shown.startswith(message + "\n" + reply + "\n["), shown  # echoed, streamed, then the status
            screen.expect("> ")
        screen.type("/reset\r")
        assert "(a new conversation)" in screen.expect("> ")
        screen.type(FIRST[0]["content"] + "\r")
        assert screen.expect(status).startswith(FIRST[0]["content"] + "\n" + replies[0] + "\n[")
        screen.expect("> ")
        screen.type("\x04")  # Ctrl-D
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)


def test_ctrl_c_cuts_a_reply_short_and_forgets_its_message(chat, monkeypatch, capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C during a reply drops it and the message it answered: the next message is the conversation's first."""
    import io

    replying = BlockwiseLM.chat

    def interrupted_once(*args, **kwargs):
        monkeypatch.setattr(BlockwiseLM, "chat", replying)
        raise KeyboardInterrupt

    monkeypatch.setattr(BlockwiseLM, "chat", interrupted_once)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Cut this short\n" + FIRST[0]["content"] + "\n"))
    main(["chat", "--model", str(chat.dir), "--max-new-tokens", "24", "--dtype", "fp32"])  # ends at the input's end
    out, err = capsys.readouterr()
    assert "(cut short: not kept)" in err
    assert out == "> > " + chat.lm.chat(FIRST, max_new_tokens=24).reply + "\n> \n"


def test_chat_refuses_a_model_without_a_chat_template(tmp_path: Path) -> None:
    tok = train_tokenizer(["abc abd"], vocab_size=270)
    toy_model("llama", vocab=len(tok), context=64).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="has no chat template"):
        main(["chat", "--model", str(tmp_path), "--dtype", "fp32"])
