"""The mirror's models dir: where each model version's file, partial and record live.

DIR/<model>/<version>/<file>                 the file, only once whole and checked
DIR/<model>/<version>/.<file>.partial        the download so far (kept to resume)
DIR/<model>/<version>/.llmgw-mirror.json     the record: source, digests, state, error

The bytes server maps <base>/<model>/<version>/<file> to the first line and nothing
else; names starting with a dot are never served.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmgw.host.files import atomic_write

# One path component: no separators, no leading dot (so never '.', '..' or a hidden file).
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)
RECORD = ".llmgw-mirror.json"

DOWNLOADING = "downloading"
PRESENT = "present"
FAILED = "failed"


def is_name(text: str) -> bool:
    """Whether text can be one path component under the models dir."""
    return bool(_NAME.match(text))


@dataclass
class Record:
    """What the mirror knows about one model version; kept on disk beside the file."""

    model: str
    version: str
    source: str
    file: str
    state: str = DOWNLOADING
    # The digest asked for in the fetch (or stated by the source), then the one computed.
    expected_sha256: str | None = None
    sha256: str | None = None
    total: int | None = None
    # The source's ETag or Last-Modified, so a resume never splices two different files.
    validator: str | None = None
    err: str = ""


class Disk:
    """The models dir and the paths of every model version in it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()

    def dir(self, model: str, version: str) -> Path:
        return self.root / model / version

    def final(self, rec: Record) -> Path:
        return self.dir(rec.model, rec.version) / rec.file

    def partial(self, rec: Record) -> Path:
        return self.dir(rec.model, rec.version) / f".{rec.file}.partial"

    def save(self, rec: Record) -> None:
        path = self.dir(rec.model, rec.version) / RECORD
        atomic_write(path, json.dumps(dataclasses.asdict(rec), indent=2) + "\n")

    def records(self) -> Iterator[Record]:
        """Every record on disk; unreadable ones are skipped (they name no servable file)."""
        fields = {f.name for f in dataclasses.fields(Record)}
        for path in sorted(self.root.glob(f"*/*/{RECORD}")):
            try:
                data = json.loads(path.read_text())
                rec = Record(**{k: v for k, v in data.items() if k in fields})
            except (OSError, ValueError, TypeError):
                continue
            if is_name(rec.model) and is_name(rec.version) and is_name(rec.file):
                yield rec
