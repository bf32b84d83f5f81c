"""The docs cover what a user meets: every ``hecate`` config key is in docs/config.md, every error message
ds_hecate raises is in docs/troubleshooting.md (found by reading the source, so a new message without a doc entry
fails here), and the statements below match what is installed and what runs."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Tuple

from ds_hecate.config import HecateConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_hecate"
MIN_FRAGMENT = 12  # shorter literal pieces ("layer ", ": ") say nothing about which message it is


def _literal_pieces(node: ast.AST) -> List[str]:
    """The constant text of a message expression: str constants, f-string parts, concatenations."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _literal_pieces(node.left) + _literal_pieces(node.right)
    return []


def _fragments(pieces: List[str]) -> List[str]:
    """Runs of text between the formatted values, normalised, long enough to identify the message."""
    out = []
    for piece in pieces:
        for part in re.split(r"%[sdrf]|\{[^}]*\}", piece):
            part = " ".join(part.replace("`", "").split()).strip(" .;:,'\"()")  # as _normalised does
            if len(part) >= MIN_FRAGMENT:
                out.append(part)
    return out


def raised_messages() -> Iterator[Tuple[str, int, List[str]]]:
    """(file, line, fragments) for every ``raise SomeError(<message>)`` in the package with literal text."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                fragments = _fragments(_literal_pieces(node.exc.args[0]))
                if fragments:
                    yield str(path.relative_to(ROOT)), node.lineno, fragments


def _normalised(text: str) -> str:
    return " ".join(text.replace("`", "").replace("\\_", "_").split())


def test_every_raised_message_is_in_troubleshooting():
    doc = _normalised((ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8"))
    missing = []
    count = 0
    for where, line, fragments in raised_messages():
        count += 1
        longest = max(fragments, key=len)
        if longest not in doc:
            missing.append(f"{where}:{line}: {longest!r}")
    assert count > 50, f"only {count} messages found: the scan is broken"
    assert not missing, "messages missing from docs/troubleshooting.md:\n" + "\n".join(missing)


def test_every_config_key_is_in_config_doc():
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    missing = [key for key in HecateConfig.model_fields if f"`{key}`" not in doc]
    assert not missing, f"hecate keys missing from docs/config.md: {missing}"


def test_scan_finds_a_known_message():
    found = [f for _, _, fragments in raised_messages() for f in fragments]
    assert any("cannot be combined with DeepSpeed's expert_parallel" in f for f in found)


def test_readme_names_the_autoload_hook_and_switch_as_installed():
    """The README's automatic-activation paragraph names the .pth file setup.py installs and the switch the hook
    reads (tests/test_autoload.py runs them)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pth_line = re.search(r'AUTOLOAD_PTH = "([^"]+)"', (ROOT / "setup.py").read_text(encoding="utf-8"))
    switch_line = re.search(r'ENV_SWITCH = "([^"]+)"', (ROOT / "ds_hecate_autoload.py").read_text(encoding="utf-8"))
    assert pth_line is not None and switch_line is not None
    pth, switch = pth_line.group(1), switch_line.group(1)
    assert f"`{pth}`" in readme and (ROOT / pth).read_text(encoding="utf-8").strip() == "import ds_hecate_autoload"
    assert f"`{switch}=0`" in readme


def test_hf_doc_refuses_no_precision_the_readme_supports():
    """The README says bf16 and fp16 run at every ZeRO stage; the Hugging Face page must not say otherwise (it said
    "fp16 is refused" while the Trainer ran fp16; tests/test_autoload.py runs an fp16 Trainer run)."""
    readme = _normalised((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "bf16 (every stage) and fp16" in readme
    hf = _normalised((ROOT / "docs" / "huggingface.md").read_text(encoding="utf-8"))
    refusing = [s for s in re.split(r"(?<=[.;])\s", hf)
                if re.search(r"\b(fp16|bf16)\b", s) and re.search(r"refused|not supported|unsupported", s)]
    assert not refusing, refusing
