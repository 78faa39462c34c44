#!/usr/bin/env python3
"""Tokenizes text into an OOMTOK01 token file, oom-train's --data (include/oom/io/token_file.hpp).

  python3 scripts/make_token_file.py --tokenizer /models/Qwen3-30B-A3B --out data.tok corpus/*.txt
  python3 scripts/make_token_file.py --bytes --out data.tok notes.md more.jsonl

Inputs are documents: each line of a .jsonl or .json file is one (its "text" field, or --field; the
extension in any case; a blank line is no record), and any other file, .txt / .md, is one. A
document with no tokens (an empty file, "text": "", text the tokenizer makes nothing of) is
skipped, not written as a lone EOS; the last line counts them. The tokens are written as they
come, into a temporary file beside --out that is renamed onto it once complete, so --out is either
the old file or the whole new one. A UTF-8 byte order mark at the start of a file is dropped (the
last line counts the files). The corpus never sits in memory whole: a JSON line is read and
tokenized at a time, and with --bytes a .txt file is read a MiB at a time (a tokenizer takes a
.txt file whole, as one document).

  --tokenizer DIR  a Hugging Face tokenizer (a model directory with tokenizer.json or the like;
                   read with transformers' AutoTokenizer, offline). Its vocab is len(tokenizer);
                   its EOS token ends every document unless --no-eos.
  --bytes          UTF-8 bytes as tokens (vocab 256, no EOS): the built-in demo model's tokens
                   (examples/configs/tiny-moe.json), no dependencies.
The file holds u16 tokens where the vocab fits (<= 65536), else u32, and records the document
count. A progress line goes to stderr every few seconds; the last line says what was written.
"""
import argparse
import codecs
import json
import os
import struct
import sys
import tempfile
import time
from array import array

MAGIC = b"OOMTOK01"
VERSION = 1
HEADER = 64
CHUNK = 1 << 20  # bytes of a text file read at a time: the memory a file takes, whatever its size


def text_pieces(path, start):
    """A text file's text from byte start on, a CHUNK of its bytes at a time, exactly as they are
    (CR LF stays CR LF)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = start  # bytes before this chunk
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            raw = f.read(CHUNK)
            held = len(decoder.getstate()[0])  # the start of a character cut at the chunk's edge
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:  # e.start counts from the held bytes
                sys.exit(f"{path}: not UTF-8 text ({e.reason} at byte {done - held + e.start})")
            if not raw:
                return
            done += len(raw)
            if text:
                yield text


def documents(paths, field, boms):
    """(source, pieces) per document, in order: pieces yields its text a part at a time. A UTF-8 byte
    order mark at the start of a file is not text (Windows tools write one): it is dropped and the
    file appended to boms."""
    for path in paths:
        with open(path, "rb") as f:
            bom = f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8
        if bom:
            boms.append(path)
        if path.lower().endswith((".jsonl", ".json")):  # in any case: .JSONL read as text had tokenized its JSON
            with open(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    if n == 1 and bom:
                        raw = raw[len(codecs.BOM_UTF8):]
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        sys.exit(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})")
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        sys.exit(f"{path}:{n}: not a JSON line ({e.msg}; .jsonl and .json files are read as JSON lines, a record a line)")
                    if not isinstance(record, dict):  # a .json file of one array or object, say
                        sys.exit(f"{path}:{n}: a JSON {type(record).__name__}, not an object (JSON lines: a record a line)")
                    if not isinstance(record.get(field), str):
                        sys.exit(f"{path}:{n}: no string field '{field}' (--field names another)")
                    yield f"{path}:{n}", (record[field],)
        else:
            yield path, text_pieces(path, len(codecs.BOM_UTF8) if bom else 0)


def byte_tokens(source, text):
    """(token count, the tokens as the file holds them): text's UTF-8 bytes as u16 little-endian."""
    try:
        utf8 = text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate a JSON escape made
        sys.exit(f"{source}: text that UTF-8 cannot hold ({e.reason} at character {e.start})")
    tokens = bytearray(2 * len(utf8))
    tokens[0::2] = utf8  # each byte a token's low byte (a list of ints took 8 bytes a byte)
    return len(utf8), tokens


def tokenizer_tokens(tok, code, vocab, eos):
    """encode(source, text): (token count, the tokens as the file holds them), tok's ids then eos
    (unless None); none for text without ids, so that an empty document is not a lone EOS."""
    width = array(code).itemsize

    def encode(source, text):
        try:
            ids = array(code, tok.encode(text, add_special_tokens=False))
        except UnicodeEncodeError as e:  # a lone surrogate a JSON escape made
            sys.exit(f"{source}: text that UTF-8 cannot hold ({e.reason} at character {e.start})")
        except OverflowError:
            sys.exit(f"{source}: a token id past {2 ** (8 * width) - 1}")
        if not ids:
            return 0, ids
        if eos is not None:
            ids.append(eos)
        if ids and max(ids) >= vocab:
            sys.exit(f"{source}: token {max(ids)} >= the vocab {vocab}")
        if sys.byteorder != "little":
            ids.byteswap()
        return len(ids), ids

    return encode


def plural(n, noun):
    return f"{n} {noun}{'s' * (n != 1)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help=".txt/.md files (a document each) or .jsonl/.json files (a document a line)")
    ap.add_argument("--out", required=True, help="the token file to write")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", help="Hugging Face tokenizer directory (offline)")
    how.add_argument("--bytes", action="store_true", help="UTF-8 bytes as tokens (vocab 256)")
    ap.add_argument("--field", default="text", help="the text field of .jsonl/.json records (default: text)")
    ap.add_argument("--no-eos", action="store_true", help="do not end each document with the tokenizer's EOS token")
    args = ap.parse_args()
    seen = {}
    for path in args.inputs:
        if os.path.isdir(path):
            sys.exit(f"{path}: a directory; name its files (e.g. {os.path.join(path, '*.txt')})")
        if not os.path.isfile(path):
            sys.exit(f"{path}: no such file")
        # The same file twice would be tokenized twice, its documents in the corpus twice.
        st = os.stat(path)  # the same file by any name, hard links included
        key = (st.st_dev, st.st_ino)
        if key in seen:
            sys.exit(f"{path}: the same file as {seen[key]}, named twice: its documents would be in the corpus twice")
        seen[key] = path

    if args.bytes:
        vocab, eos = 256, None
    else:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            sys.exit("--tokenizer needs transformers (pip install transformers); --bytes needs nothing")
        try:
            tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        except Exception as e:  # transformers raises several kinds for a directory it cannot read
            sys.exit(f"{args.tokenizer}: cannot load a tokenizer ({type(e).__name__}: {e})")
        # Added tokens may sit past len(tok) (gaps in their ids): the vocab covers every id.
        vocab = max(len(tok), max(tok.get_vocab().values(), default=-1) + 1)
        eos = None if args.no_eos else tok.eos_token_id
        if not args.no_eos and eos is None:
            sys.exit(f"{args.tokenizer}: the tokenizer has no EOS token; pass --no-eos to write documents back to back")
    code = "H" if vocab <= 1 << 16 else "I"
    width = 2 if code == "H" else 4
    encode = byte_tokens if args.bytes else tokenizer_tokens(tok, code, vocab, eos)

    if os.path.isdir(args.out):
        sys.exit(f"{args.out}: a directory; --out names the token file to write")
    # Written over one of its inputs, the text would be gone (it had been, without a word).
    for path in args.inputs:
        same = os.path.exists(args.out) and os.path.exists(path) and os.path.samefile(args.out, path)
        if same or os.path.realpath(args.out) == os.path.realpath(path):
            sys.exit(f"{args.out}: is the input {path}; writing it would destroy that input (name another --out)")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        sys.exit(f"{args.out}: no directory {out_dir} to write it in")
    fd, tmp = tempfile.mkstemp(prefix=".make_token_file.", dir=out_dir)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # as any new file (mkstemp's are the owner's alone)
    count = docs = empty = 0
    boms = []
    started = last = time.monotonic()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER)  # the header, once the counts are known
            for source, pieces in documents(args.inputs, args.field, boms):
                if not args.bytes:  # a tokenizer takes a document whole: its pieces' seams would change the tokens
                    pieces = ("".join(pieces),)
                before = count
                for text in pieces:
                    n, tokens = encode(source, text)
                    f.write(tokens)
                    count += n
                    if time.monotonic() - last > 5:
                        last = time.monotonic()
                        print(f"{plural(docs, 'document')}, {count} tokens ({count / (last - started):.0f} tokens/s)", file=sys.stderr)
                if count == before:
                    empty += 1
                else:
                    docs += 1
            if count == 0:
                sys.exit("no tokens: the inputs hold no text" + (f" ({plural(empty, 'empty document')})" if empty else ""))
            f.seek(0)
            f.write(MAGIC + struct.pack("<IIQQQ", VERSION, width, vocab, count, docs) + b"\0" * 24)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    skipped = f"; {plural(empty, 'empty document')} skipped" if empty else ""
    dropped = f"; a UTF-8 byte order mark dropped from the start of {plural(len(boms), 'file')}" if boms else ""
    print(f"wrote {args.out}: {count} tokens ({width} bytes each, vocab {vocab}) in {plural(docs, 'document')}{skipped}{dropped}")


if __name__ == "__main__":
    main()
