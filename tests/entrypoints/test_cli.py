"""The CLI as a person uses it: answers from the bundled model, one-line errors with exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

PAGODA = [sys.executable, "-m", "pagoda.entrypoints.cli"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PAGODA, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("pagoda: error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_model_file(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    assert_one_line_error(run_cli("generate", "--model", missing, "hi"), missing, "no such file")


def test_not_a_model_file(tmp_path) -> None:
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("just some text, not a model\n" * 10)
    assert_one_line_error(run_cli("generate", "--model", str(bogus), "hi"), str(bogus), "not a GGUF")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "readme.txt").write_text("nothing here")
    assert_one_line_error(run_cli("generate", "--model", str(folder), "hi"), "not a model folder")


def test_truncated_gguf(tmp_path, bundled_gguf) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(bundled_gguf, "rb") as src:
        truncated.write_bytes(src.read(4_000_000))
    assert_one_line_error(run_cli("generate", "--model", str(truncated), "hi"), "truncated")


def test_unsupported_architecture(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    assert_one_line_error(
        run_cli("generate", "--model", str(tmp_path), "hi"), "GPT2LMHeadModel", "LlamaForCausalLM"
    )


def test_bad_sampling_value() -> None:
    assert_one_line_error(run_cli("generate", "--temperature", "-1", "hi"), "temperature")


@pytest.mark.slow
def test_generate_answers_from_bundled_model() -> None:
    result = run_cli("generate", "--max-tokens", "32", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_chat_repl_answers_resets_and_exits() -> None:
    script = "What is the capital of France?\n/reset\nSay hello.\n/exit\n"
    result = run_cli("chat", "--max-tokens", "24", stdin=script)
    assert result.returncode == 0, result.stderr
    # input() writes its "> " prompt to stdout, so stdout is "> reply1\n> > reply2\n> "
    turns = [t.strip() for t in result.stdout.split("> ") if t.strip()]
    assert len(turns) == 2, result.stdout
    assert "Paris" in turns[0]
    assert "(history cleared)" in result.stderr


class RecordingLLM:
    """Stands in for LLM.chat: records the conversation each turn sends."""

    def __init__(self) -> None:
        self.sent: list[list[dict]] = []

    def chat(self, messages, params, use_tqdm=False):
        from pagoda.outputs import CompletionOutput, RequestOutput

        self.sent.append([dict(m) for m in messages])
        reply = CompletionOutput(index=0, text=f"reply {len(self.sent)}")
        return [RequestOutput("r", None, [], [reply], finished=True)]


def test_chat_session_sends_history_and_reset_clears_it() -> None:
    from pagoda.entrypoints.cli import ChatSession

    llm = RecordingLLM()
    session = ChatSession(llm, params=None, system="Be brief.")
    assert session.send("My name is Ada.") == "reply 1"
    session.send("What is my name?")
    assert llm.sent[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "What is my name?"},
    ]
    session.reset()
    session.send("Who am I?")
    assert llm.sent[2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who am I?"},
    ]


def test_env_prints_the_cpu_features_and_what_auto_picks() -> None:
    """CI's machines have a C compiler, so the float32 kernels build and `auto` keeps the
    bundled Q4_1 file in 4 bits with the kernel attention, whatever the CPU."""
    from pagoda.executor.kernels.cpu_info import cpu_features

    result = run_cli("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"features seen: {' '.join(cpu_features())}" in out
    assert "Pagoda's CPU kernels: float32 on " in out
    assert "quantization int4 (Q4_1 file)" in out and "attention cpu-kernel" in out
    assert ("dtype bfloat16" in out) == ("bfloat16: yes" in out)


def test_env_on_a_missing_model_is_a_one_line_error(tmp_path) -> None:
    assert_one_line_error(run_cli("env", "--model", str(tmp_path / "nope.gguf")), "nope.gguf")
