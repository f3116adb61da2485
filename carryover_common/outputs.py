"""The one rule for what a command writes: it never deletes or overwrites a file it did not write in this run unless
the user asked (`--overwrite_output_dir`, or resuming a run of the same command). Every CLI checks its output folder
with `check_output_dir` before any model is loaded, and writes its results through `write_atomic` or `staged_folder`,
so that an interrupted or failed run leaves the previous results whole."""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def write_atomic(path: Path, write) -> None:
    """`write(temp_path)`, then rename: a reader (or a resumed run) never sees a half-written file."""
    temp = path.with_name(path.name + ".tmp")
    write(temp)
    os.replace(temp, path)


def check_output_dir(
    output_dir,
    *,
    inputs=(),
    resumable: bool = False,
    overwrite: bool = False,
    files=None,
    flag: str | None = "--overwrite_output_dir true",
    name: str = "--output_dir",
) -> Path:
    """Raise a ValueError, before any work, if writing to `output_dir` could destroy a user's files:
    - it is, or lies inside, one of `inputs` (the command's own input folders and files);
    - it already holds files (or, with `files`, one of those names: a folder several commands share) and is neither a
      run this command resumes (`resumable`: its own checks then compare the settings) nor one the user gave up
      (`overwrite`). `flag` is the flag that allows it; None for commands that only resume."""
    output = Path(output_dir)
    for source in inputs:
        if source and (output.resolve() == Path(source).resolve() or Path(source).resolve() in output.resolve().parents):
            where = "is" if output.resolve() == Path(source).resolve() else "lies inside"
            raise ValueError(
                f"{name} {output_dir} {where} the input {source}: writing there would replace it. "
                f"Choose a {name} outside it."
            )
    if output.exists() and not output.is_dir():
        raise ValueError(f"{name} {output_dir} is a file, not a folder: choose a folder.")
    if resumable or overwrite or not output.is_dir():
        return output
    existing = sorted(p.name for p in output.iterdir() if files is None or p.name in files)
    if existing:
        shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
        fix = f"pass {flag} to replace them, or choose" if flag else "choose"
        raise ValueError(
            f"{name} {output_dir} already holds files that this run did not write ({shown}): {fix} a new {name}."
        )
    return output


@contextmanager
def staged_folder(output_dir, replace: bool = False):
    """Yield a temporary folder beside `output_dir` to write results into; when the block ends without error, its
    entries are moved into `output_dir` (replacing those of the same name; `replace=True`: the whole folder), so an
    interrupted or failed run leaves the previous results whole. On error the temporary folder is removed."""
    output = Path(output_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        yield staging
        if replace and output.exists():
            old = output.with_name(staging.name + ".old")
            output.rename(old)
            staging.rename(output)
            shutil.rmtree(old)
            return
        move_into(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_into(staging, output_dir) -> None:
    """Move every file of the complete folder `staging` into `output_dir` at the same relative path, replacing a file
    of that name (an atomic rename each); other files of `output_dir` stay. Then remove `staging`."""
    staging, output = Path(staging), Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    for entry in staging.iterdir():
        if entry.is_dir():  # merged, not replaced: e.g. an evaluation's <drafter>/T1/ stays beside a new T0/
            move_into(entry, output / entry.name)
        else:
            os.replace(entry, output / entry.name)
    staging.rmdir()
