"""Print the N-th command of README.md's "Two commands" section (one bash block each)."""

import re
import sys

text = open("README.md").read()
section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
n = int(sys.argv[1])
lines = [line.split("  #", 1)[0].strip() for line in blocks[n - 1].splitlines()]
print(" && ".join(line for line in lines if line))
