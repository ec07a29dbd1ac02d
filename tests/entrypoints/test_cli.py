"""The CLI as a person uses it: answers from the bundled model, one-line errors with exit 2;
and the shape of pagoda/cli/: one module per subcommand, no import cycle, a fast --help."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import pagoda.cli

pytestmark = pytest.mark.slow  # (make test-fast skips it)

PAGODA = [sys.executable, "-m", "pagoda"]
CLI_DIR = pathlib.Path(pagoda.cli.__file__).parent
CLI_MODULES = sorted(f"pagoda.cli.{p.stem}" for p in CLI_DIR.glob("*.py") if p.stem != "__init__")
SUBCOMMANDS = ("generate", "chat", "serve", "bench", "env")


def run_cli(
    *args: str, stdin: str | None = None, timeout: float = 180,
) -> subprocess.CompletedProcess:
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
    assert_one_line_error(
        run_cli("generate", "--model", str(bogus), "hi"), str(bogus), "not a GGUF"
    )
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

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
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
    from pagoda.cli.chat import ChatSession

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
    bundled Q4_1 file packed in its own types with the kernel attention, whatever the CPU."""
    from pagoda.executor.kernels.cpu_info import cpu_features

    result = run_cli("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"features seen: {' '.join(cpu_features())}" in out
    assert "Pagoda's CPU kernels: float32 on " in out
    assert "quantization the file's own types, packed (Q4_1 file)" in out
    assert "attention cpu-kernel" in out
    assert "dtype float32" in out  # on every CPU kind (BENCHMARKS.md section 19)


def test_env_on_a_missing_model_is_a_one_line_error(tmp_path) -> None:
    assert_one_line_error(run_cli("env", "--model", str(tmp_path / "nope.gguf")), "nope.gguf")


# ---- the shape of pagoda/cli/ ------------------------------------------------------------------


def import_in_fresh_python(*modules: str) -> subprocess.CompletedProcess:
    code = "".join(f"import {m}\n" for m in modules)
    code += "import sys; print(' '.join(m for m in ('torch', 'pagoda.engine') if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def test_every_cli_module_imports_first_alone_and_in_either_order() -> None:
    assert {f"pagoda.cli.{name}" for name in SUBCOMMANDS} <= set(CLI_MODULES)
    orders = [[m] for m in CLI_MODULES] + [CLI_MODULES, CLI_MODULES[::-1]]
    for order in orders:
        result = import_in_fresh_python(*order)
        assert result.returncode == 0, f"{order}:\n{result.stderr}"
        # heavy imports stay inside the command functions, so `pagoda --help` is fast
        assert result.stdout.strip() == "", f"{order} imported {result.stdout.strip()}"


def test_no_subcommand_module_imports_main() -> None:
    for path in CLI_DIR.glob("*.py"):
        if path.stem == "main":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            else:
                continue
            assert "pagoda.cli.main" not in imported, f"{path.name} imports pagoda.cli.main"


def test_python_m_pagoda_help_lists_the_subcommands() -> None:
    result = run_cli("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for name in SUBCOMMANDS:
        assert name in result.stdout


def test_serve_help_lists_server_and_generated_engine_flags() -> None:
    result = run_cli("serve", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--port", "--max-queue", "--max-num-seqs", "--no-prefix-caching",
                 "--enable-chunked-prefill", "--num-kv-blocks", "--scheduling-policy"):
        assert flag in result.stdout


def test_the_pagoda_script_points_at_cli_main() -> None:
    import tomllib

    pyproject = pathlib.Path(__file__).parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["pagoda"] == "pagoda.cli.main:main"


def test_main_exit_codes(monkeypatch, capsys) -> None:
    from pagoda.cli import generate
    from pagoda.cli.main import main

    def refuse(args):
        raise ValueError("that will not do")

    def interrupt(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run_generate", refuse)
    assert main(["generate", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "pagoda: error: that will not do"
    monkeypatch.setattr(generate, "run_generate", interrupt)
    assert main(["generate", "hi"]) == 130


def test_generate_passes_every_engine_flag_to_llm(monkeypatch) -> None:
    """The engine flags reach LLM(**kwargs) by name, and LLM accepts each as a keyword."""
    import pagoda.entrypoints.llm as llm_module
    from pagoda.cli.main import main
    from pagoda.config import EngineConfig

    built = []

    class FakeLLM(RecordingLLM):
        def __init__(self, model=None, **kwargs) -> None:
            super().__init__()
            built.append(EngineConfig.from_kwargs(model=model, **kwargs))

    monkeypatch.setattr(llm_module, "LLM", FakeLLM)
    assert main(["generate", "--max-num-seqs", "3", "--no-prefix-caching", "--device", "cpu",
                 "hi"]) == 0
    (config,) = built
    assert config.scheduler.max_num_seqs == 3
    assert config.cache.enable_prefix_caching is False
    assert config.device == "cpu"


def test_llm_rejects_an_unknown_keyword_before_loading() -> None:
    from pagoda import LLM

    with pytest.raises(TypeError, match="'max_num_sequences'.*max_num_seqs"):
        LLM(max_num_sequences=4)


def test_log_level_goes_before_or_after_the_subcommand() -> None:
    from pagoda.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "INFO"]).log_level == "INFO"
    assert parser.parse_args(["bench", "latency", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "bench", "latency"]).log_level == "ERROR"
    assert parser.parse_args(["bench", "latency"]).log_level == "WARNING"


@pytest.mark.parametrize("command", [("bench", "serve"), ("bench", "soak"), ("bench", "latency")])
def test_help_names_each_default_once(command) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "(default:" in text
    assert not re.search(r"\(default:[^()]*(\([^()]*\))?[^()]*\) \(default:", text)
