"""The embedded corpus: a function of the project and the Python (and base-files' fixed license texts), whatever else
the machine has installed; its tool conversations call the calculator as GLM writes a call, for the right answer."""

import os
import re
import shutil
import sysconfig
from pathlib import Path

import pytest

from glm46.data.chat import parse_tool_calls
from glm46.data.documents import Ledger
from glm46.data.embedded import COMMON_LICENSES, generated, license_files, license_texts, source_files
from glm46.data.tools import Calculator, ToolEnvironment
from glm46.rl.rewards import extract_answer

ANOTHER_PACKAGE = Path("/usr/share/doc/glm46-test-package")


def test_installing_a_package_leaves_the_embedded_corpus_as_it_is():
    """A package's copyright file (what `apt-get install` adds under /usr/share/doc) and a license text it might drop
    beside base-files' are read by nothing: the sources, the license documents and their texts stay the same."""
    stray = COMMON_LICENSES / "GLM46-Test-License"
    writable = (
        COMMON_LICENSES.is_dir() and os.access(COMMON_LICENSES, os.W_OK) and os.access(ANOTHER_PACKAGE.parent, os.W_OK)
    )
    if not writable or ANOTHER_PACKAGE.exists() or stray.exists():
        pytest.skip("needs a Debian-like /usr/share it may write to (root), without this test's files")
    before = source_files(), [(d.id, d.text) for d in license_texts(Ledger())]
    try:
        ANOTHER_PACKAGE.mkdir(parents=True)
        (ANOTHER_PACKAGE / "copyright").write_text("Copyright: 2026 someone\nLicense: MIT\n" * 20)
        stray.write_text("Permission is granted to do anything. " * 50)
        after = source_files(), [(d.id, d.text) for d in license_texts(Ledger())]
    finally:
        shutil.rmtree(ANOTHER_PACKAGE, ignore_errors=True)
        stray.unlink(missing_ok=True)
    assert after == before


def test_the_license_domain_reads_the_pythons_license_and_a_fixed_list_only():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = license_files()
    assert files[0] == stdlib / "LICENSE.txt"
    assert all(path.parent == COMMON_LICENSES for path in files[1:])
    assert not any("/usr/share/doc" in str(path) for path in source_files())


def test_tool_prompts_call_the_calculator_for_the_answer():
    ledger, tools = Ledger(), [Calculator().schema]
    documents = list(generated(ledger, 0, 0, seed=3, tool_prompts=20))
    assert len(documents) == 20 and {d.domain for d in documents} == {"tool"}
    environment = ToolEnvironment()
    for document in documents:
        question = re.search(r"<\|user\|>\nWhat is (\d{4}) \* (\d{2})\?<\|assistant\|>", document.text)
        a, b = int(question[1]), int(question[2])
        assert '"name": "calculator"' in document.text.split("<|user|>")[0]  # the tools block lists it
        reply = document.text[question.end() :]
        call_turn, result, answer_turn = re.split(r"<\|observation\|>|<\|assistant\|>", reply)
        (call,) = parse_tool_calls(call_turn, tools)
        assert call == {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
        assert environment.step(call) == str(a * b) and str(a * b) in result
        assert extract_answer(answer_turn) == a * b


@pytest.mark.parametrize(("share", "low", "high"), [(None, 150, 250), (0.03, 35, 90), (0.0, 0, 0)])
def test_sft_tool_share_sets_how_many_sft_conversations_use_the_tool(share, low, high):
    """A tenth by default (source.options.sft_tool_share); experiment=toy_recipe_tools sets fewer."""
    options = {} if share is None else {"sft_tool_share": share}
    documents = list(generated(Ledger(), 0, 0, seed=0, sft_conversations=2000, **options))
    with_tools = sum("<tool_call>calculator" in d.text for d in documents)
    assert low <= with_tools <= high and len(documents) == 2000
    with pytest.raises(ValueError, match=r"^source\.options\.sft_tool_share=1\.5: a share"):
        next(generated(Ledger(), 0, 0, seed=0, sft_tool_share=1.5))


def test_copy_drills_repeat_their_numbers_and_only_when_asked_for():
    """experiment=toy_recipe_tools's drill; the default corpus (copy_drills=0) has none, so it is as it was."""
    documents = list(generated(Ledger(), 0, 0, seed=0, copy_drills=200))
    assert len(documents) == 200 and {d.domain for d in documents} == {"copy"}
    for document in documents:
        first, again = re.fullmatch(r"Numbers: ([\d ]+)\nAgain: ([\d ]+)", document.text).groups()
        numbers = first.split()
        assert first == again and 3 <= len(numbers) <= 8 and all(2 <= len(n) <= 5 for n in numbers)
    assert len({d.text for d in documents}) == 200
    assert not any(d.domain == "copy" for d in generated(Ledger(), 10, 10, seed=0, sft_conversations=10))
