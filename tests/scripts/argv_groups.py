"""`ARGS [::: ARGS ...]` → one argument list per group: the scripts that run several trainings in one launch."""

SEP = ":::"


def split_args(argv: list[str]) -> list[list[str]]:
    groups, cur = [], []
    for a in argv:
        if a == SEP:
            groups.append(cur)
            cur = []
        else:
            cur.append(a)
    return [*groups, cur]
