# Arguments are any objects with the buffer protocol (bytes, numpy arrays, memoryviews);
# numpy's arrays are not typed as `Buffer`, hence `object`.
def prefix_rows(packed: object, slots: object, h0: object, h1: object, ns_col: object, shift: int, ns: int,
                ns_fp: int, check_ns: bool, out: object, /) -> int: ...
