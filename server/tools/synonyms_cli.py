"""`infercache synonyms check FILE`: whether a synonym dictionary (server/shared/synonyms.py) can serve.

Exit 0 with a summary when it can; 1 with one line per problem (file:line: what, and what to do) when
it cannot; 2 when the file cannot be read or a line is malformed.
"""

from __future__ import annotations

from pathlib import Path

from server.shared.printable import printable
from server.shared.synonyms import SynonymError, Synonyms, parse, problems


def check(path: Path) -> int:
    try:
        entries = parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, SynonymError) as exc:
        print(f"infercache: {printable(str(exc))}")
        return 2
    found = problems(entries, str(path))
    for problem in found:
        print(printable(problem))
    if found:
        print(f"{path}: {len(found)} problem(s); the server refuses a model whose dictionary has any")
        return 1
    table = Synonyms({e.phrase: e.canonical for e in entries})
    print(f"{path}: {len(table)} phrases to {len(set(table.table.values()))} canonical forms, no problems "
          f"(fingerprint {table.fingerprint}, part of the model's key namespace)")
    return 0
