#!/usr/bin/env python3
"""One target's copy of a program as a single relocatable object whose static initializers the C runtime
does not run (tools/dispatch/dispatch_main.cpp runs them once it has chosen the target).

    isolate.py LD OBJCOPY READELF ARCHIVE OUTPUT TARGET

Links ARCHIVE's objects into one (ld -r) and renames its .init_array section to pp_init_TARGET, whose
bounds the linker then exports as __start_pp_init_TARGET / __stop_pp_init_TARGET. Refuses an object with
prioritized initializers, .ctors or .fini_array: their order or their running could not be kept.
"""
import re
import subprocess
import sys


def main():
    ld, objcopy, readelf, archive, output, target = sys.argv[1:7]
    if not re.fullmatch(r"[a-z0-9_]+", target):
        sys.exit(f"isolate.py: bad target name {target!r}")
    tmp = output + ".r.o"
    subprocess.run([ld, "-r", "--whole-archive", archive, "-o", tmp], check=True)
    sections = subprocess.run([readelf, "-SW", tmp], check=True, capture_output=True, text=True).stdout
    names = set(re.findall(r"\]\s+(\S+)\s+[A-Z0-9_]+\s+[0-9a-f]{16}", sections))
    bad = sorted(n for n in names if n.startswith((".init_array.", ".ctors", ".fini_array", ".dtors")))
    if bad:
        sys.exit(f"isolate.py: {archive}: sections {', '.join(bad)} cannot be deferred to the dispatcher")
    # A defined C-linkage symbol has no namespace to rename: every copy would define the same one and all
    # of them would use the lowest copy's (an `extern "C"` signal handler setting another copy's flag).
    syms = subprocess.run(["nm", "--defined-only", tmp], check=True, capture_output=True, text=True).stdout
    shared = sorted({f[2] for f in (l.split() for l in syms.splitlines())
                     if len(f) == 3 and f[1].isupper() and not f[2].startswith(("_Z", "DW.ref."))})
    if shared:
        sys.exit(f"isolate.py: {archive}: C-linkage symbols {', '.join(shared[:8])} would be shared by every "
                 "kernel target's copy: give them C++ linkage in a namespace")
    args = [objcopy]
    if ".init_array" in names:
        args += ["--rename-section", f".init_array=pp_init_{target}"]
    subprocess.run(args + [tmp, output], check=True)


if __name__ == "__main__":
    main()
