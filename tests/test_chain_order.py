"""codegen/chain_order.py on random statement graphs (Hypothesis): whatever the graph, the order it
gives _chain_tokens is a permutation of the statements in which every statement comes after the
statements that make what it reads (a rendered epilogue would otherwise read a name before it is
made). The examples' rendered epilogues are tested in tests/test_backward.py."""
from hypothesis import given, settings
from hypothesis import strategies as st

from lrdsl.codegen.chain_order import Stmt, order
from lrdsl.codegen.plan import Load


@st.composite
def graphs(draw):
    """The statements _chain_tokens is made of, as chain_order.statements lays them out: loads
    (vector gradients and inputs, [BT, BK] tiles or [BT, 1] numbers), an optional floor of b_dgl,
    shared subexpressions over loads, key-channel gradients and per-token sums over any of them
    (b_du and b_dgl come in as arguments), then the sums' stores."""
    n_loads = draw(st.integers(1, 5))
    loads = []
    for i in range(n_loads):
        kind = draw(st.sampled_from(("K", "scalar")))
        loads.append(Stmt("input_load", Load(f"x{i}", f"b_x{i}", kind, False, False), (f"b_x{i}",),
                          tile=kind == "K"))
    made = [s.defines[0] for s in loads]
    tiles = {s.defines[0] for s in loads if s.tile} | {"b_du"}
    out = list(loads)
    if draw(st.booleans()):
        out.append(Stmt("floor", None, ("b_dgl",), frozenset(draw(st.sets(st.sampled_from(made), max_size=2)))))
    for j in range(draw(st.integers(0, 3))):
        reads = frozenset(draw(st.sets(st.sampled_from(made), min_size=1, max_size=3)))
        out.append(Stmt("temp", (f"t{j}", ""), (f"t{j}",), reads, tile=bool(reads & tiles)))
        tiles |= {f"t{j}"} if reads & tiles else set()
        made.append(f"t{j}")
    sums = []
    for s in loads:
        reads = frozenset(draw(st.sets(st.sampled_from([*made, "b_du", "b_dgl"]), min_size=1, max_size=4)))
        if s.arg.kind == "K":
            out.append(Stmt("key_grad", s.arg, (), reads | {s.defines[0]}, consumer=True))
        else:
            out.append(Stmt("key_grad", s.arg, ("s_" + s.arg.name,), reads, consumer=True))
            sums.append(s.arg)
    out += [Stmt("scalar_store", a, (), frozenset({"s_" + a.name}), consumer=True) for a in sums]
    return tuple(out)


@settings(max_examples=300, deadline=None)
@given(graphs())
def test_order_is_a_permutation_that_makes_every_name_before_its_readers(stmts):
    out = order(stmts)
    assert sorted(map(id, out)) == sorted(map(id, stmts))
    at = {id(s): i for i, s in enumerate(out)}
    maker = {d: s for s in stmts for d in s.defines}
    for s in out:
        for name in s.reads:
            if name in maker and maker[name] is not s:
                assert at[id(maker[name])] < at[id(s)], (name, s.macro)
