"""`meshtron tokenize --data SOURCE --out NAME.bin [--tokenizer byte|FILE.json]`: a text source
tokenized once into a token shard (NAME.bin + NAME.bin.json, `meshtron.data.write_token_shard`)
that `meshtron train --data NAME.bin` reads through a memory map.

The same readers (and UTF-8 check) as `train --data`; each document is followed by EOS, as a
run tokenizes it; the sidecar records the tokenizer's fingerprint, so training with another
tokenizer is refused. Outside `meshtron.data` on purpose: that package imports torch, and
`meshtron --help` builds this parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshtron.errors import UserError


def cmd_tokenize(args: argparse.Namespace) -> int:
    out = _check_out(args.out, args.overwrite)
    from meshtron.data import write_token_shard
    from meshtron.data.pipeline import check_source_key, read_documents
    from meshtron.data.text_check import warning_lines
    from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_file

    if args.tokenizer != "byte" and tokenizer_file(args.tokenizer) is None:
        raise UserError(f"--tokenizer={args.tokenizer!r}: allowed values are byte, a "
                        "tokenizer.json or a folder holding one")
    tok = ByteTokenizer() if args.tokenizer == "byte" else HFTokenizer.load(args.tokenizer)
    warnings: list[str] = []
    check_source_key(args.data, args.json_key)
    docs = read_documents(args.data, jsonl_field=args.json_key, warnings=warnings)
    for line in warning_lines(warnings):
        print(f"meshtron tokenize: warning: {line}", file=sys.stderr)
    ids = tok.encode_documents(docs)
    try:
        write_token_shard(out, ids, tok.vocab_size,
                          meta={"tokenizer": tok.fingerprint, "source": str(args.data),
                                "documents": len(docs)})
    except OSError as exc:
        raise UserError(f"--out={args.out!r}: cannot be written ({exc.strerror})") from None
    flag = "" if args.tokenizer == "byte" else f" --tokenizer {args.tokenizer}"
    plural = "s" if len(docs) > 1 else ""
    print(f"{out}: {len(ids):,} tokens of {len(docs):,} document{plural}, vocabulary "
          f"{tok.vocab_size:,}; train on it: meshtron train --data {out}{flag}")
    return 0


def _check_out(value: str, overwrite: bool) -> Path:
    out = Path(value)
    if out.suffix.lower() != ".bin":
        raise UserError(f"--out={value!r}: must end in .bin (what --data reads as a token shard)")
    if out.is_dir():
        raise UserError(f"--out={value!r}: is a folder, expected a file name")
    if any(parent.is_file() for parent in out.parents):
        raise UserError(f"--out={value!r}: a folder on its path is a file")
    if out.exists() and not overwrite:
        raise UserError(f"--out={value!r}: exists; --overwrite replaces it")
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="tokenize text once into a token shard for train --data",
                       description="Read a text source as `meshtron train --data` does (UTF-8 "
                                   "checked), tokenize it, each document followed by EOS, and "
                                   "write NAME.bin (token ids) and NAME.bin.json (dtype, "
                                   "vocabulary, token count, tokenizer fingerprint).")
    p.add_argument("--data", default="stdlib", metavar="SOURCE",
                   help="'stdlib', a text file or folder, or a .jsonl or .json of JSON "
                        "Lines (text field) [default: stdlib]")
    p.add_argument("--json-key", default="text", metavar="FIELD",
                   help="the field of each JSON Lines record that holds its text, as "
                        "`train --json-key` [default: text]")
    p.add_argument("--tokenizer", default="byte",
                   help="byte | a Hugging Face tokenizer.json (or its folder) [default: byte]")
    p.add_argument("--out", required=True, metavar="NAME.bin", help="the shard to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard")
    p.set_defaults(func=cmd_tokenize)
