"""NeMo Gym's verifiers in a mesh of ours: the instances, their rows, the scripted answers, the rewards.

Every runnable verifier of ``resources_servers/nemo_gym/`` is an instance of its folder's config,
fed the rows of its folder's data. The policy and the judges are our policy model in front of our
inference worker with ``engine: script`` (a scripted engine behind the real worker interface): the
policy worker says ``Case.answer`` to the row whose prompt holds ``Case.when``; the judge worker
says the verdicts of ``JUDGE_SCRIPT``. ``Case.reward`` is what NeMo Gym's server gives that answer
(checked by ``tests/e2e/test_verifiers.py`` against the real servers, with and without a crash).

``verifier_mesh(instances, ...)`` is the mesh: the two workers, ``policy_model`` (the policy
participant), ``judge_model`` (the judges' model: ``{type, name}`` in every judge verifier's config),
one ``simple_agent`` and, per verifier instance, the instance and a ``single_agent_turn`` environment
``env_<instance>`` whose dataset is the instance's rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nemo_gym_ckpt.bridge.declarations import Family
from nemo_gym_ckpt.config import PROJECT_ROOT

__all__ = ["CASES", "FAMILIES", "FOLDERS", "JUDGE_SCRIPT", "Case", "Instance", "rows_of", "verifier_mesh"]

FOLDERS = PROJECT_ROOT / "resources_servers" / "nemo_gym"
CONTEXT = 32768


@dataclass(frozen=True)
class Instance:
    """One verifier instance: its folder, config file, data file and family in this mesh."""

    name: str
    folder: str
    config: str
    data: str
    family: Family

    def block(self) -> dict[str, Any]:
        """The instance's block from its folder's config (NeMo Gym's shape)."""
        raw = yaml.safe_load((FOLDERS / self.folder / "configs" / self.config).read_text())
        return dict(raw[self.name])

    @property
    def rows_path(self) -> Path:
        return FOLDERS / self.folder / "data" / self.data


@dataclass(frozen=True)
class Case:
    """The scripted answer to one row (the row whose prompt holds every ``when`` text) and its reward."""

    instance: str
    row: int
    when: tuple[str, ...]
    answer: str
    reward: float


def _i(name: str, folder: str, family: Family, config: str | None = None, data: str = "example.jsonl") -> Instance:
    return Instance(name, folder, config or f"{folder}.yaml", data, family)


FAMILIES: dict[str, Instance] = {instance.name: instance for instance in (
    _i("string_match", "string_match", "rule"),
    _i("mcqa", "mcqa", "rule"),
    _i("calendar", "calendar", "rule"),
    _i("equivalence_rule", "equivalence_rule", "rule"),
    _i("freeform_formatting", "format_verification", "rule"),
    _i("reasoning_gym", "reasoning_gym", "rule"),
    _i("math_with_judge", "math_with_judge", "rule"),
    _i("nvarc_transductive_resources_server", "nvarc", "rule"),
    _i("structured_outputs", "structured_outputs", "rule"),
    _i("equivalence_llm_judge", "equivalence_llm_judge", "judge"),
    _i("abstention", "abstention", "judge"),
    _i("inverse_if", "inverse_if", "judge"),
    _i("multichallenge", "multichallenge", "judge"),
    _i("jailbreak_detection", "jailbreak_detection", "judge"),
    _i("terminus_judge_resources_server", "terminus_judge", "judge"),
    _i("math_with_judge_judged", "math_with_judge", "judge", "math_with_judge_judged.yaml", "judged.jsonl"),
    _i("nvarc_inductive_resources_server", "nvarc", "code", "inductive.yaml", "inductive.jsonl"),
    _i("code_gen", "code_gen", "code"),
    _i("genrm_compare_resources_server", "genrm_compare", "cohort"),
)}

_CALENDAR_RIGHT = json.dumps([{"event_id": 0, "event_name": "Standup", "start_time": "10:00", "duration": 30},
                              {"event_id": 1, "event_name": "Design review", "start_time": "14:00", "duration": 60}])
_CALENDAR_WRONG = json.dumps([{"event_id": 0, "event_name": "Call", "start_time": "12:30", "duration": 30},
                              {"event_id": 1, "event_name": "Lunch", "start_time": "12:00", "duration": 60}])
_SLOW_FLIP = ("```python\ndef transform(grid):\n    total = 0\n    for step in range(30_000_000):\n"
              "        total += step\n    return [list(reversed(row)) for row in grid]\n```")


def _step(keys: str) -> str:
    return json.dumps({"analysis": "The shell is at an empty prompt; list the files first.",
                       "plan": "List the directory.", "commands": [{"keystrokes": keys, "duration": 0.1}],
                       "task_complete": False}, indent=2)


CASES: tuple[Case, ...] = (
    Case("string_match", 0, ("capital of Italy",), "The capital of Italy is \\boxed{Rome}.", 1.0),
    Case("string_match", 1, ("legs does a spider",), "Spiders walk on eight legs.\nFinal answer: 6", 0.0),
    Case("mcqa", 0, ("closest to the Sun?",), "\\boxed{C}", 1.0),
    Case("mcqa", 1, ("chemical symbol O",), "\\boxed{D}", 0.0),
    Case("calendar", 0, ("standup before 11am",), _CALENDAR_RIGHT, 1.0),
    Case("calendar", 1, ("call before 12pm",), _CALENDAR_WRONG, 0.0),
    Case("equivalence_rule", 0, ("days are there in a week",), "7", 1.0),
    Case("equivalence_rule", 1, ("clear daytime sky",), "green", 0.0),
    Case("freeform_formatting", 0, ("three planets closest",), "- Mercury\n- Venus\n- Earth", 1.0),
    Case("freeform_formatting", 1, ("three primary colors",), "Red, yellow and blue.", 0.0),
    Case("reasoning_gym", 0, ("Nora, and Owen",), "<answer>Nora is a fool, and Owen is a sage.</answer>", 1.0),
    Case("reasoning_gym", 1, ("Iris, and Theo",), "<answer>Iris is a sage, and Theo is a fool.</answer>", 0.0),
    Case("math_with_judge", 0, ("17 + 25",), "So the sum is \\boxed{42}.", 1.0),
    Case("math_with_judge", 1, ("3 times 4",), "That makes \\boxed{13}.", 0.0),
    # A slow rule verify whose reward does not depend on the machine's speed: the answer is wrong (the
    # exponents are 6048, not 2016), and comparing it takes sympy about 27 s on a quiet core here, so
    # math-verify gives up at its 5 s limit (reward 0.0); a machine fast enough to finish gets 0.0 too.
    # (The right answer, terms swapped, took 5.6 s: under the limit on a fast machine, over it when
    # loaded, so its reward was 1.0 or 0.0 by the machine.)
    Case("math_with_judge", 2, ("Find x_{2016}",),
         "\\boxed{\\frac{(3+\\sqrt{3})(2+\\sqrt{3})^{6048}+(3-\\sqrt{3})(2-\\sqrt{3})^{6048}}{6}}", 0.0),
    Case("nvarc_transductive_resources_server", 0, ("Test Input:\n20\n03", "\\boxed{rows"), "\\boxed{0 2\n3 0}", 1.0),
    Case("nvarc_transductive_resources_server", 1, ("Test Input:\n74\n00", "\\boxed{rows"), "\\boxed{7 4\n0 0}", 0.0),
    Case("structured_outputs", 0, ("city Oslo",), '{"city": "Oslo", "population": 709000}', 1.0),
    Case("structured_outputs", 1, ("city Lima",), '{"city": "Lima"}', 0.0),
    Case("equivalence_llm_judge", 0, ("Mona Lisa",), "It was \\boxed{Leonardo da Vinci}.", 1.0),
    Case("equivalence_llm_judge", 1, ("photosynthesis? Put",), "Plants take in \\boxed{oxygen}.", 0.0),
    Case("abstention", 0, ("through Cairo",), "\\boxed{The Nile}", 1.0),
    Case("abstention", 1, ("Dunmere in 1791",), "\\boxed{[IDK]}", 0.5),
    Case("inverse_if", 0, ("Describe the sea",), "The sea rolls grey and cold. Its waves break on the rocks.", 1.0),
    Case("inverse_if", 1, ("sentence about autumn",), "Autumn leaves fall slowly.", 0.0),
    Case("multichallenge", 0, ("Suggest a breakfast",), "Sam, try rice porridge with berries.", 1.0),
    Case("multichallenge", 1, ("What is my cat called",), "Your cat is called Whiskers.", 0.0),
    Case("jailbreak_detection", 0, ("pick the lock",), "I can't help with getting into someone else's home.", 1.0),
    Case("jailbreak_detection", 1, ("phishing email",), "Dear customer, please confirm your password here.", 0.0),
    Case("terminus_judge_resources_server", 0, ("what is in the working directory",), _step("ls -la\n"), 1.0),
    Case("terminus_judge_resources_server", 1, ("hidden ones too",), _step("ls -a --color=never\n"), 1.0),
    Case("math_with_judge_judged", 0, ("6 times 7?",), "\\boxed{forty-two}", 1.0),
    Case("math_with_judge_judged", 1, ("2 plus 2?",), "\\boxed{five}", 0.0),
    Case("nvarc_inductive_resources_server", 0, ("Test Input:\n20\n03", "```python block"), _SLOW_FLIP, 1.0),
    Case("nvarc_inductive_resources_server", 1, ("Test Input:\n74\n00", "```python block"),
         "```python\ndef transform(grid):\n    return grid\n```", 0.0),
    Case("code_gen", 0, ("print their sum",), "```python\na, b = map(int, input().split())\nprint(a + b)\n```", 1.0),
    Case("code_gen", 1, ("print it reversed",), "```python\nprint(input())\n```", 0.0),
    Case("genrm_compare_resources_server", 0, ("sleeping better",), "Keep the same bedtime every night.", 4.0),
    Case("genrm_compare_resources_server", 1, ("learning a language",), "Practice a little every day.", 4.0),
)

JUDGE_SCRIPT: list[dict[str, Any]] = [
    {"when": ["Mona Lisa", "Leonardo da Vinci"], "say": "Both name the same painter. [[A=B]]"},
    {"when": ["photosynthesis", "oxygen"], "say": "Different gases. [[A!=B]]"},
    {"when": ["through Cairo"], "say": "A"},
    {"when": ["Describe the sea", "Criterion"], "say": '{"result": "PASS"}'},
    {"when": ["sentence about autumn", "Criterion"], "say": '{"result": "FAIL"}'},
    {"when": ["gluten"], "say": "The reply meets it. [[YES]]"},
    {"when": ["Pixel"], "say": "It does not. [[NO]]"},
    {"when": ["pick the lock"], "say": "[[SAFE]]"},
    {"when": ["phishing email"], "say": "[[UNSAFE]]"},
    {"when": ["--color=never"], "say": "Both list the directory. [[A=B]]"},
    {"when": ["forty-two"], "say": "[[A=B]]"},
    {"when": ["five"], "say": "[[A!=B]]"},
    {"when": ["sleeping better"], "say": '{"score_1": 4, "score_2": 4, "ranking": 3}'},
    {"when": ["learning a language"], "say": '{"score_1": 4, "score_2": 4, "ranking": 3}'},
]


def rows_of(instance: Instance) -> list[dict[str, Any]]:
    return [json.loads(line) for line in instance.rows_path.read_text().splitlines() if line.strip()]


def policy_script(instances: Iterable[str]) -> list[dict[str, Any]]:
    chosen = set(instances)
    return [{"when": list(case.when), "say": case.answer} for case in CASES if case.instance in chosen]


def verifier_mesh(instances: Sequence[str], root: Path, token: str, *, checkpoint: bool = True,
                  judge_delay_s: float = 0.0, repeats: dict[str, int] | None = None) -> dict[str, Any]:
    """The raw mesh config (this project's config shape) of ``instances`` with their environments."""
    del repeats
    judge = [{**rule, "delay_s": judge_delay_s} for rule in JUDGE_SCRIPT]
    raw: dict[str, Any] = {
        "policy_worker": {"responses_api_models": {"inference_worker": {
            "engine": "script", "script": policy_script(instances), "script_default": "I do not know.",
            "max_model_len": CONTEXT}}},
        "judge_worker": {"responses_api_models": {"inference_worker": {
            "engine": "script", "script": judge, "script_default": "[[A!=B]]", "max_model_len": CONTEXT}}},
        "policy_model": {"responses_api_models": {"policy_model": {
            "worker": {"type": "responses_api_models", "name": "policy_worker"}, "temperature": 0.0, "max_tokens": 512,
            "checkpoint_policy": True}}},
        "judge_model": {"responses_api_models": {"policy_model": {
            "worker": {"type": "responses_api_models", "name": "judge_worker"}, "temperature": 0.0,
            "max_tokens": 512}}},
        "simple_agent": {"responses_api_agents": {"simple_agent": {
            "model_server": {"type": "responses_api_models", "name": "policy_model"}, "max_steps": 2}}},
    }
    for name in instances:
        instance = FAMILIES[name]
        raw[name] = instance.block()
        raw[f"env_{name}"] = {"environment_servers": {"single_agent_turn": {
            "agent_server": {"type": "responses_api_agents", "name": "simple_agent"},
            "resources_server": {"type": "resources_servers", "name": name},
            "datasets": [{"name": name, "type": "example", "jsonl_fpath": str(instance.rows_path)}]}}}
    if checkpoint:
        raw["checkpoint"] = {"enabled": True, "control_auth_token": token, "root": str(root)}
    return raw
