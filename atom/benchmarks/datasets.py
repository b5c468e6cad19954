"""Prompt sources of the serving benchmark, read from local files only (vLLM's ``benchmark_dataset.py``):
``random`` synthetic prompts; ``sharegpt`` a ShareGPT JSON file; ``sonnet`` a text file of poem lines;
``burstgpt`` a BurstGPT trace CSV; ``hf`` a dataset saved with ``save_to_disk`` or a local
``.json``/``.jsonl``/``.csv``/``.parquet`` file. Lengths are counted with the benchmark's tokenizer."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DATASET_NAMES = ["sharegpt", "burstgpt", "sonnet", "random", "hf"]


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def num_tokens(tokenizer, text: str) -> int:
    """Tokens in ``text`` itself, without the BOS/EOS the tokenizer may add."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def apply_chat_template(tokenizer, prompt: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template, needed for --use-chat-template and the sonnet dataset.")
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class BenchmarkDataset:
    def __init__(self, dataset_path: str | None = None, random_seed: int = 0) -> None:
        self.dataset_path, self.random_seed = dataset_path, random_seed
        # own generators: sampling is reproducible whatever else uses the global random state
        self.rng, self.np_rng = random.Random(random_seed), np.random.default_rng(random_seed)

    def _records(self, subset: str | None = None, split: str | None = None) -> list[dict[str, Any]]:
        if not self.dataset_path:
            raise ValueError(f"The {type(self).__name__} needs --dataset-path (a local dataset file or directory).")
        return load_local_records(self.dataset_path, subset, split)


def prompt_token_ids(tokenizer) -> np.ndarray:
    """Token ids usable in synthetic prompts: not special (they would change the prompt's meaning), and
    decoding to text that encodes back to the same single token (byte fragments of a UTF-8 character
    decode to U+FFFD and would keep prompts from reaching their target length)."""
    special_ids = set(tokenizer.all_special_ids)
    candidates = [i for i in range(tokenizer.vocab_size) if i not in special_ids]
    encoded = tokenizer(tokenizer.batch_decode([[i] for i in candidates]), add_special_tokens=False).input_ids
    allowed = [i for i, ids in zip(candidates, encoded) if ids == [i]]
    # for a tokenizer where almost nothing round-trips, length fitting is approximate but works
    return np.array(allowed if len(allowed) >= len(candidates) // 10 else candidates)


class RandomDataset(BenchmarkDataset):
    """Prompts of random tokens, lengths drawn uniformly from ``[int(length * range_ratio), length]``.
    Decoding random ids and encoding the text again changes the token count, so each prompt's tail is
    padded or trimmed until it re-encodes to its target length; ``prompt_len`` is always measured."""

    def sample(
        self, tokenizer, n, prefix_len=0, range_ratio=1.0, input_len=1024, output_len=128, use_chat_template=False
    ):
        if not 0.0 <= range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}.")
        if input_len < 1 or output_len < 1 or prefix_len < 0:
            raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0.")
        allowed_ids, template_len = prompt_token_ids(tokenizer), 0
        if use_chat_template:  # the template's tokens count towards input_len
            template_len = num_tokens(tokenizer, apply_chat_template(tokenizer, "a")) - 1
            if (input_len := input_len - template_len) < 1:
                raise ValueError(f"--random-input-len leaves no room for the chat template ({template_len} tokens).")
        # a shared prefix of identical text, e.g. to measure prefix caching
        prefix_text = tokenizer.decode(self.np_rng.choice(allowed_ids, size=prefix_len).tolist()) if prefix_len else ""
        in_lens = self.np_rng.integers(int(input_len * range_ratio), input_len + 1, size=n)
        out_lens = self.np_rng.integers(int(output_len * range_ratio), output_len + 1, size=n)
        offsets = self.np_rng.integers(0, len(allowed_ids), size=n)
        requests, mismatches = [], []
        for i in range(n):
            target_len = prefix_len + int(in_lens[i])
            # consecutive ids from a random offset, as in vLLM: cheap and different for every request
            body = tokenizer.decode(allowed_ids[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed_ids)].tolist())
            # only the body is adjusted, so every prompt starts with exactly the same prefix text
            for _ in range(10):
                if (diff := target_len - num_tokens(tokenizer, prefix_text + body)) == 0:
                    break
                ids = tokenizer.encode(body, add_special_tokens=False)
                more = self.np_rng.choice(allowed_ids, size=diff).tolist() if diff > 0 else []
                body = tokenizer.decode(ids + more if diff > 0 else ids[: max(len(ids) + diff, 0)])
            prompt = prefix_text + body
            if use_chat_template:
                prompt, target_len = apply_chat_template(tokenizer, prompt), target_len + template_len
            requests.append(SampleRequest(prompt, num_tokens(tokenizer, prompt), int(out_lens[i])))
            mismatches.append(requests[-1].prompt_len - target_len)
        mean_len = np.mean([r.prompt_len for r in requests])
        logger.info("Random dataset: mean input_len %.2f (mean token mismatch %.2f)", mean_len, np.mean(mismatches))
        return requests


def prompt_and_completion(record: dict[str, Any]) -> tuple[str, str | None]:
    """Prompt and reference completion of a record in the layouts vLLM supports (ShareGPT or OpenAI
    messages, AIMO, InstructCoder) or a plain prompt/completion layout."""
    if turns := record.get("conversations") or record.get("messages"):
        texts = [t.get("value", t.get("content")) for t in turns]
        return texts[0], texts[1] if len(texts) > 1 else None
    if "problem" in record:
        return record["problem"], record.get("solution")
    if "instruction" in record:
        return record["instruction"] + (f":\n{record['input']}" if record.get("input") else ""), record.get("output")
    for key in ("prompt", "question", "text"):
        if key in record:
            answers = (record[k] for k in ("completion", "response", "answer", "output") if record.get(k))
            return record[key], next(answers, None)
    columns = "conversations, messages, problem, instruction, prompt, question or text"
    raise ValueError(f"Cannot find a prompt in dataset record with columns {sorted(record)}; expected {columns}.")


def load_local_records(path: str, subset: str | None = None, split: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``save_to_disk`` directory (or its ``subset`` sub-directory), or of a
    .json/.jsonl/.csv/.parquet/.arrow file; the directory and parquet/arrow need ``datasets``."""
    if subset and os.path.isdir(os.path.join(path, subset)):
        path = os.path.join(path, subset)
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path) or (ext in (".parquet", ".arrow") and os.path.isfile(path)):
        try:
            import datasets
        except ImportError as err:
            raise ImportError(f"Reading {path} needs the 'datasets' package (pip install datasets).") from err
        if not os.path.isdir(path):
            return list(datasets.load_dataset(ext[1:], data_files=path, split="train"))
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            data = data[split or ("train" if "train" in data else next(iter(data)))]
        return list(data)
    if not os.path.isfile(path) or ext not in (".json", ".jsonl", ".csv"):
        raise ValueError(
            f"--dataset-path {path!r} is not a local directory nor a .json/.jsonl/.csv/.parquet file. Datasets are "
            "only read from local data, never downloaded: save an hf dataset beforehand, e.g. "
            "`datasets.load_dataset(NAME, split=SPLIT).save_to_disk(DIR)`, and pass DIR."
        )
    with open(path, newline="", encoding="utf-8") as f:
        if ext != ".json":
            return list(csv.DictReader(f)) if ext == ".csv" else [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
        return data if isinstance(data, list) else data[split or "train"]


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's pruning rule for real datasets: no side under 4 tokens, prompts up to 1024, totals up to 2048."""
    too_short = prompt_len < 4 or (output_len < 4 and not skip_min_output_len_check)
    return not (too_short or prompt_len > 1024 or prompt_len + output_len > 2048)


class HuggingFaceDataset(BenchmarkDataset):
    """Prompt/completion records; the completion's length is the output length (128 for records without
    one, unless ``output_len`` is given). Records with a measured completion are pruned as vLLM does."""

    def __init__(self, dataset_subset: str | None = None, dataset_split: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.data = [prompt_and_completion(r) for r in self._records(dataset_subset, dataset_split)]
        self.rng.shuffle(self.data)

    def sample(self, tokenizer, num_requests: int, output_len: int | None = None, **kwargs) -> list[SampleRequest]:
        samples: list[SampleRequest] = []
        for prompt, completion in self.data:
            if len(samples) >= num_requests:
                break
            if not prompt:
                continue
            prompt_len = len(tokenizer(prompt).input_ids)
            n = output_len if output_len is not None else len(tokenizer(completion).input_ids) if completion else 128
            if self._keep(prompt_len, n, fixed=output_len is not None, measured=bool(completion)):
                samples.append(SampleRequest(prompt, prompt_len, n))
        if not samples:
            raise ValueError(f"No usable samples in {self.dataset_path}.")
        # repeat random samples when the data holds fewer usable entries than requested
        return samples + self.rng.choices(samples, k=max(num_requests - len(samples), 0))

    def _keep(self, prompt_len: int, output_len: int, fixed: bool, measured: bool) -> bool:
        return fixed or not measured or is_valid_sequence(prompt_len, output_len)


class ShareGPTDataset(HuggingFaceDataset):
    """First human turn as the prompt, the first reply's length as the output length."""

    def _records(self, subset: str | None = None, split: str | None = None) -> list[dict[str, Any]]:
        return [e for e in super()._records() if len(e.get("conversations", [])) >= 2]

    def _keep(self, prompt_len: int, output_len: int, fixed: bool, measured: bool) -> bool:
        return is_valid_sequence(prompt_len, output_len, skip_min_output_len_check=fixed)


class SonnetDataset(BenchmarkDataset):
    """Prompts asking the model to pick poem lines; the leading lines form a shared prefix."""

    BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if not self.dataset_path or not os.path.isfile(self.dataset_path):
            raise ValueError(f"The sonnet dataset needs --dataset-path, a local text file (got {self.dataset_path}).")
        with open(self.dataset_path, encoding="utf-8") as f:
            if not (data := [line for line in f if line.strip()]):
                raise ValueError(f"The sonnet file {self.dataset_path} has no lines.")
        self.data = data

    def sample(
        self, tokenizer, num_requests, prefix_len=200, input_len=550, output_len=150, return_prompt_formatted=False
    ):
        line_len = np.mean([len(tokenizer(line).input_ids) for line in self.data])
        base_len = len(tokenizer(apply_chat_template(tokenizer, self.BASE_PROMPT)).input_ids)
        if input_len <= base_len:
            raise ValueError(f"--sonnet-input-len must be higher than the base prompt length ({base_len}).")
        num_lines = round((input_len - base_len) / line_len)
        num_prefix = max(round((prefix_len - base_len) / line_len), 0)
        if num_lines <= num_prefix:
            raise ValueError(f"--sonnet-input-len {input_len} leaves no lines after the prefix of {prefix_len} tokens.")
        samples: list[SampleRequest] = []
        # random lines may overshoot input_len and are redrawn; the cap turns a hopeless setting into an error
        for _ in range(100 * num_requests):
            if len(samples) >= num_requests:
                break
            lines = self.data[:num_prefix] + self.rng.choices(self.data, k=num_lines - num_prefix)
            prompt = self.BASE_PROMPT + "".join(lines)
            formatted = apply_chat_template(tokenizer, prompt)
            if (prompt_len := len(tokenizer(formatted).input_ids)) <= input_len:
                samples.append(SampleRequest(formatted if return_prompt_formatted else prompt, prompt_len, output_len))
        if len(samples) < num_requests:
            raise ValueError(f"Could not build sonnet prompts of at most {input_len} tokens.")
        return samples


class BurstGPTDataset(BenchmarkDataset):
    """Request/response lengths of a BurstGPT trace's GPT-4 rows with a response, as random prompts."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        rows, columns = self._records(), ("Model", "Request tokens", "Response tokens")
        if rows and (missing := [c for c in columns if c not in rows[0]]):
            raise ValueError(f"{self.dataset_path} is not a BurstGPT CSV: missing columns {missing}.")
        lens = [(int(float(r[columns[1]])), int(float(r[columns[2]]))) for r in rows if r["Model"] == "GPT-4"]
        if not (data := [(i, o) for i, o in lens if o > 0]):
            raise ValueError(f"No GPT-4 rows with a response in {self.dataset_path}.")
        self.data = data

    def sample(self, tokenizer, num_requests: int, **kwargs) -> list[SampleRequest]:
        n, data = num_requests, self.data
        rows = self.rng.sample(data, n) if n <= len(data) else self.rng.choices(data, k=n)
        prompts = RandomDataset(random_seed=self.random_seed)
        return [prompts.sample(tokenizer, 1, input_len=max(i, 1), output_len=o)[0] for i, o in rows]


def get_samples(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """The requests of the dataset ``args.dataset_name``, sampled with its group of flags (``--random-*`` ...)."""
    name, n, files = args.dataset_name, args.num_prompts, dict(dataset_path=args.dataset_path, random_seed=args.seed)
    opts = {k.removeprefix(f"{name}_"): v for k, v in vars(args).items() if k.startswith(f"{name}_")}
    if args.use_chat_template and name != "random":
        logger.warning("--use-chat-template only applies to the random dataset; ignored for %s.", name)
    if args.use_chat_template and args.backend == "openai-chat":
        logger.warning("--use-chat-template with the openai-chat backend applies the chat template twice.")
    if name == "random":
        return RandomDataset(random_seed=args.seed).sample(
            tokenizer, n, use_chat_template=args.use_chat_template, **opts
        )
    if name == "sonnet":  # a chat server applies the template itself; the completions API needs the templated text
        return SonnetDataset(**files).sample(
            tokenizer, n, return_prompt_formatted=args.backend != "openai-chat", **opts
        )
    if name == "hf":
        return HuggingFaceDataset(opts.pop("subset"), opts.pop("split"), **files).sample(tokenizer, n, **opts)
    return {"sharegpt": ShareGPTDataset, "burstgpt": BurstGPTDataset}[name](**files).sample(tokenizer, n, **opts)
