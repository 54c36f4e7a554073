"""The environment demo: an escape-room vault that SmolLM2-135M-Instruct learns to open.

    python examples/vault_game.py                  # writes out/vault/rooms.jsonl (the prompts)
    python train.py --config vault.py              # GRPO with environment_factory = VaultRoom

Each episode is one room: a vault locked with a 4-digit code, and a note that tells the code. The
policy plays it in turns through the environment's two tools, written as TRL's docs write an
environment: `read_note()` returns the note, `open_vault(code)` tries a code. The environment keeps
the room's state (the code, the tries) and owns the reward (`get_reward`): 1 when the vault opened
with at most two tries (success), partial credit for reading the note and then trying a code,
nothing for reading it and stopping.
The code is drawn per room and shown nowhere but in the note, so a
completion that guesses, or that stops after reading the note, does not succeed: the policy has to
call one tool, read the result, and call the other with what it read.

The prompt spells out the tool-call format (SmolLM2's ChatML template ignores `tools=`) and one
worked room with another code; the test split's codes are new. The worked room writes its code as a
JSON number, as the model writes one: when it showed a string ("3201"), trained models mixed the
two forms, and a third of one seed's held-out calls were broken JSON ({"code": 2033"}}}).
"""

import json
import os
import random

SYSTEM = (
    "You are in an escape room with a locked vault. Tools: read_note() reads the note in the "
    "room; open_vault(code) tries a code on the vault. Read the note, then open the vault with "
    'its code. To use a tool write only <tool_call>{"name": "<tool>", "arguments": {...}}'
    "</tool_call> and wait for the result."
)


class VaultRoom:
    """One room: a vault locked with a 4-digit code, and a note that tells it."""

    def __init__(self):
        self.code = ""
        self.opened = False
        self.reads = 0
        self.tries = 0

    def reset(self, code: str, **kwargs) -> str:
        """A new room whose vault opens with `code` (the dataset row's column)."""
        self.code, self.opened, self.reads, self.tries = str(code), False, 0, 0
        return " The vault is locked."

    def read_note(self) -> str:
        """Read the note that lies in the room.

        Returns:
            What the note says.
        """
        self.reads += 1
        return f"The vault code is {self.code}."

    def open_vault(self, code: int) -> str:
        """Try a code on the vault.

        Args:
            code: The 4-digit code to try.

        Returns:
            Whether the vault opened.
        """
        self.tries += 1
        if str(code).strip() == self.code and self.tries <= 2:
            self.opened = True
            return "The vault opens."
        return "Wrong code. The vault stays locked."

    def get_reward(self) -> float:
        """1 for an opened vault (success). Partial credit only for the whole move toward it: 0.4
        for reading the note once and then trying a code (0.3 if it read the note again and again).
        Reading the note and stopping earns 0, as nothing does: were reading alone paid, a group
        whose completions all read and stop would tie (no advantage left), and the tokens that end
        the turn after the note would be the ones reinforced on the way there."""
        if self.opened:
            return 1.0
        if self.reads and self.tries:
            return 0.4 if self.reads == 1 else 0.3
        return 0.0


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def rows(n: int, seed: int) -> list[dict]:
    """n rooms: the system prompt, one worked room (another code), then the task; `code` is the
    room's code, which reset() receives."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # no leading zero: written as a JSON number (the model's habit), 0693 is not JSON
        shown, code = (str(rng.randint(1000, 9999)) for _ in range(2))
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Open the vault. The vault is locked."},
            {"role": "assistant", "content": call("read_note")},
            {"role": "tool", "name": "read_note", "content": f"The vault code is {shown}."},
            {"role": "assistant", "content": call("open_vault", code=int(shown))},
            {"role": "tool", "name": "open_vault", "content": "The vault opens."},
            {"role": "assistant", "content": "The vault is open."},
            {"role": "user", "content": "Open the vault."},
        ]
        out.append({"prompt": messages, "code": code})
    return out


if __name__ == "__main__":
    os.makedirs("out/vault", exist_ok=True)
    for split, n, seed in (("rooms", 2000, 0), ("rooms_test", 64, 1)):
        with open(f"out/vault/{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
    print("wrote out/vault/rooms.jsonl and out/vault/rooms_test.jsonl")
