"""The tool-calling demo task: multi-digit products that a 135M model can only get right with a
calculator.

    python examples/tool_calculator.py   # writes out/tools/products.jsonl (the prompts)
    python train.py --config tools.py    # GRPO on SmolLM2-135M-Instruct with the `multiply` tool

Each prompt asks for a product of a 3-digit and a 2-digit number. The system prompt states the
call format of the `multiply` tool (Hermes `<tool_call>` JSON; SmolLM2's ChatML template ignores
`tools=`, so the format is spelled out, short, to keep prompts ~120 tokens), then one worked
example conversation (question, tool call, tool result, answer) precedes the question.
`product_reward` is 1 when the last assistant turn states the right product: the policy earns it
by calling the tool and repeating its result.
"""

import json
import os
import random
import re


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


SYSTEM = (
    "You are a helpful assistant with a calculator tool, multiply(a, b). To use it, write only "
    '<tool_call>{"name": "multiply", "arguments": {"a": <int>, "b": <int>}}</tool_call> and wait '
    "for the result. Then answer with the number."
)


def product_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last assistant turn contains the exact product (digits only), else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer):
        last = next(
            (m.get("content") or "" for m in reversed(completion) if m["role"] == "assistant"), ""
        )
        scores.append(1.0 if str(gold) in re.sub(r"[,\s]", "", last) else 0.0)
    return scores


def tool_called(completions, **kwargs) -> list[float]:
    """A diagnostic reward (weight 0 in configs/tools.py): 1.0 when the completion called a tool."""
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]


def call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def rows(n: int, seed: int, shots: int = 1) -> list[dict]:
    """n prompts: the system prompt, `shots` worked example conversations (a question, the
    assistant's tool call, the tool's result, the answer), then the question."""
    rng, system = random.Random(seed), SYSTEM
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": system}]
        for _ in range(shots):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            messages += [
                {"role": "user", "content": f"What is {a} * {b}?"},
                {"role": "assistant", "content": call_text(a, b)},
                {"role": "tool", "name": "multiply", "content": str(a * b)},
                {"role": "assistant", "content": str(a * b)},
            ]
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        out.append(
            {
                "prompt": messages + [{"role": "user", "content": f"What is {a} * {b}?"}],
                "answer": str(a * b),
            }
        )
    return out


if __name__ == "__main__":
    os.makedirs("out/tools", exist_ok=True)
    for split, n, seed in (("products", 2000, 0), ("products_test", 64, 1)):
        with open(f"out/tools/{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
    print("wrote out/tools/products.jsonl and out/tools/products_test.jsonl")
