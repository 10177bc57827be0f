"""The README is a front page: every link in it and in docs/ resolves (a file, and a heading where it names one),
every docs/ page is linked from the README, the README stays under 200 lines, and every command in its code
blocks names scripts and configs that exist and flags that the script accepts. Each check has a negative control
on a made-up page."""
import glob
import os
import re
import subprocess
import sys

from helpers import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set:
    with open(path) as fh:
        text = re.sub(r"```.*?```", "", fh.read(), flags=re.S)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def link_problems(page: str, text: str) -> list:
    """Links of `text` (the page at `page`) that lead nowhere: a missing file or a missing heading."""
    problems = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            problems.append(f"{os.path.relpath(page, REPO)}: {target} (no such file)")
        elif fragment and resolved.endswith(".md") and fragment not in anchors(resolved):
            problems.append(f"{os.path.relpath(page, REPO)}: {target} (no such heading)")
    return problems


def pages() -> list:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def test_every_link_in_the_readme_and_docs_resolves():
    assert [problem for page in pages() for problem in link_problems(page, open(page).read())] == []


def test_the_link_check_finds_a_missing_page_and_a_missing_heading():
    page = os.path.join(REPO, "README.md")
    assert link_problems(page, "[a](docs/nothing.md) [b](docs/data.md#no-such-heading) [c](docs/data.md)") == [
        "README.md: docs/nothing.md (no such file)", "README.md: docs/data.md#no-such-heading (no such heading)"]


def test_every_docs_page_is_linked_from_the_readme_which_stays_a_front_page():
    readme = open(os.path.join(REPO, "README.md")).read()
    linked = {os.path.normpath(target.partition("#")[0]) for target in LINK.findall(readme)}
    unlinked = [p for p in pages()[1:] if os.path.relpath(p, REPO) not in linked]
    assert unlinked == []
    assert readme.count("\n") <= 200


def commands(text: str) -> list:
    """The README's shell commands: each code block's lines, continuations joined, comments dropped."""
    out = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


INLINE = re.compile(r"`((?:python3? |deepspeed |bash |torchrun |sbatch )[^`]*scripts/[^`]*)`")


def doc_commands(text: str) -> list:
    """A docs page's commands: its ```bash blocks' lines and its inline `python scripts/...`-like spans."""
    return commands(text) + [span.strip() for span in INLINE.findall(text)]


def required_flags(usage: str) -> set:
    """The flags argparse's usage line shows outside brackets: those a command must give."""
    bare = usage
    while re.search(r"\[[^\[\]]*\]", bare):
        bare = re.sub(r"\[[^\[\]]*\]", "", bare)
    return set(re.findall(r"(--[\w-]+)", bare))


def help_text(script: str, cache={}) -> str:
    if script not in cache:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": REPO}
        cache[script] = subprocess.run([sys.executable, os.path.join(REPO, script), "--help"], capture_output=True,
                                       text=True, env=env, cwd=REPO, timeout=300).stdout
    return cache[script]


def command_problems(line: str) -> list:
    """Files a command names that do not exist, and --flags its Python script does not list in its --help."""
    problems = []
    words = line.replace("&&", " ").split()
    for word in words:
        if re.match(r"^(scripts|configs|ds_configs|benchmarks)/\S+\.(py|sh|yaml|json|sbatch)$", word):
            if not os.path.exists(os.path.join(REPO, word)):
                problems.append(f"{line}: {word} does not exist")
    scripts = [w for w in words if w.startswith("scripts/") and w.endswith(".py")]
    if scripts and os.path.exists(os.path.join(REPO, scripts[0])):
        known = help_text(scripts[0])
        after = words[words.index(scripts[0]) + 1:]
        problems += [f"{line}: {scripts[0]} has no {flag}" for flag in after
                     if flag.startswith("--") and not re.search(re.escape(flag.split("=")[0]) + r"\b", known)]
        usage = known.split("\n\n")[0]
        given = {flag.split("=")[0] for flag in after}
        problems += [f"{line}: {scripts[0]} needs {flag}" for flag in sorted(required_flags(usage) - given)
                     if "--help" not in given]
    return problems


def test_every_readme_command_names_files_that_exist_and_flags_its_script_takes():
    readme = open(os.path.join(REPO, "README.md")).read()
    lines = commands(readme)
    assert "bash scripts/setup_env.sh && DS_ACCELERATOR=cpu deepspeed --num_gpus 2 scripts/train.py" in lines
    assert "bash scripts/test.sh" in lines and len(lines) >= 8
    assert [problem for line in lines for problem in command_problems(line)] == []


def test_every_docs_command_names_files_that_exist_and_flags_its_script_takes_and_needs():
    """docs/ as the README: code blocks and inline commands, each run as written would parse."""
    lines = [line for page in pages()[1:] for line in doc_commands(open(page).read())]
    assert len(lines) >= 20
    assert [problem for line in lines for problem in command_problems(line)] == []


def test_the_command_check_finds_a_missing_script_and_an_unknown_flag():
    assert command_problems("python scripts/nothing.py --x") == ["python scripts/nothing.py --x: scripts/nothing.py "
                                                                 "does not exist"]
    assert command_problems("python scripts/plan.py --model qwen3-8b --no-such-flag") == [
        "python scripts/plan.py --model qwen3-8b --no-such-flag: scripts/plan.py has no --no-such-flag"]
    assert command_problems("python scripts/plan.py --nodes 2") == [  # the required flag missing
        "python scripts/plan.py --nodes 2: scripts/plan.py needs --model"]
    assert doc_commands("Predict with `python scripts/plan.py --nodes N` first.") == ["python scripts/plan.py --nodes N"]
