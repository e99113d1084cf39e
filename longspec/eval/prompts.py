"""Prompt construction: LongBench's own per-task templates and a chat-templated math prompt.

The LongBench templates are copied verbatim from THUDM/LongBench `config/dataset2prompt.json` (the long-output
tasks the paper evaluates: gov_report, qmsum, multi_news, lcc, repobench-p). LongBench formats the template with
the row's `context` and `input` fields and feeds it as raw text (no chat template) to base / long-context models.
"""

from __future__ import annotations

__all__ = [
    "LONGBENCH_TEMPLATES",
    "NO_CHAT_TASKS",
    "GENERIC_TEMPLATE",
    "uses_chat",
    "MATH_INSTRUCTION",
    "longbench_prompt",
    "math_messages",
]

LONGBENCH_TEMPLATES: dict[str, str] = {
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench's pred.py wraps every prompt in the model's chat template except these (few-shot and code-completion
# tasks, whose prompt is itself the text to continue). Our instruct-target suite follows the same rule.
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

# Local JSONL rows whose `dataset` is not a LongBench long-output task.
GENERIC_TEMPLATE = "{context}\n\n{input}"

# The instruction Qwen's QwQ / math evaluations append to every problem.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def longbench_prompt(task: str | None, context: str, question: str) -> str:
    """LongBench's template for `task` (GENERIC_TEMPLATE for unknown / missing tasks) filled with a row.
    LongBench-E rows (`gov_report_e`, ...) use their task's template, as LongBench's pred.py does."""
    task = (task or "").removesuffix("_e")
    template = LONGBENCH_TEMPLATES.get(task, GENERIC_TEMPLATE)
    # str.replace, not str.format: contexts (code!) contain braces.
    return template.replace("{context}", context).replace("{input}", question)


def math_messages(problem: str) -> list[dict[str, str]]:
    """One user turn for the target's chat template."""
    return [{"role": "user", "content": problem + "\n" + MATH_INSTRUCTION}]


def uses_chat(task: str | None, row_chat: bool | None) -> bool:
    """Whether a JSONL row's prompt goes through the target's chat template: the row's own `chat` field when it
    has one (the instruct suite writes it), else never (LongBench's raw-text protocol for base models)."""
    if row_chat is None:
        return False
    return bool(row_chat) and (task or "").removesuffix("_e") not in NO_CHAT_TASKS
