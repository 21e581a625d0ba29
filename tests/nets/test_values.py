"""Nets and update rules are values: equal ones built separately share cache entries and compiled
programs, ones that differ in anything never do; initialisation reads each tensor's declared role,
never its name; a Net is required where a net is meant."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import rendered, train
from gradtie.checks import bugs
from gradtie.nets import cifar8, protocol, resnet34
from gradtie.nets.protocol import DRAWN_GAMMA, ParamSpec


def test_equal_nets_share_cache_entries_and_programs_different_ones_never():
    twin = dataclasses.replace(cifar8.NET)                  # built separately, equal in every field
    other = dataclasses.replace(cifar8.NET, channels=1)     # one field differs
    assert twin is not cifar8.NET and twin == cifar8.NET and hash(twin) == hash(cifar8.NET)
    assert other != cifar8.NET and cifar8.NET != resnet34.NET
    cfg = cifar8.Config(head_width=8)
    names = protocol._bn_names(cifar8.NET, cfg)
    hits = protocol._bn_names.cache_info().hits
    assert protocol._bn_names(twin, cfg) is names
    assert protocol._bn_names.cache_info().hits == hits + 1                # the twin hit the entry
    misses = protocol._bn_names.cache_info().misses
    protocol._bn_names(cifar8.NET, cifar8.Config(head_width=9))           # one config field differs
    assert protocol._bn_names.cache_info().misses == misses + 1

    params = cifar8.NET.init(jax.random.key(0), cfg)
    x = jnp.zeros((1, 3, 32, 32), jnp.float32)
    rendered.forward(cifar8.NET, params, x, cfg)
    size = rendered.forward._cache_size()
    rendered.forward(twin, params, x, cfg)
    assert rendered.forward._cache_size() == size                          # the same compiled program
    shifted = dataclasses.replace(cifar8.NET, stage_list=lambda c: cifar8.NET.stage_list(c))
    rendered.forward(shifted, params, x, cfg)
    assert rendered.forward._cache_size() == size + 1                      # another net: another program

    # a planted chain built twice is one net; planted in another net, another
    a, b = (bugs.plant("relu_mask_from_conv_output", cifar8.NET).net for _ in range(2))
    assert a is not b and a == b and a != cifar8.NET
    assert a != bugs.plant("relu_mask_from_conv_output", resnet34.NET).net


def test_update_rules_hash_by_value():
    a, b = train.nesterov.__wrapped__(0.9), train.nesterov.__wrapped__(0.9)
    assert a is not b and a == b and hash(a) == hash(b)
    assert a != train.nesterov.__wrapped__(0.8) and a != train.heavy_ball(0.9)
    assert train.adamw.__wrapped__() == train.adamw.__wrapped__()
    assert train.adamw.__wrapped__() != train.adamw.__wrapped__(weight_decay=0.0)



def _holding(array):
    """An update rule whose closure holds an array (an object keyed by identity)."""
    def update(params, grads, state, lr):
        return {k: v - lr * array.sum() * grads[k] for k, v in params.items()}, state
    return train.Optimizer("holding", lambda params: {}, update, {})


def test_identity_keys_stay_bounded_and_never_reused():
    import gc
    kept = np.ones(3)
    a, b = _holding(kept), _holding(kept)
    assert a == b and hash(a) == hash(b)                      # one array: one key while it lives
    assert a != _holding(np.ones(3))                          # an equal array elsewhere: another key
    held = len(protocol._HELD)
    keys = set()
    for _ in range(300):                                      # a long loop over fresh nets and rules
        rule = _holding(np.ones(3))
        keys.add(rule._fingerprint)
        del rule
    gc.collect()         # once: a collection per rule costs minutes in a worker holding compiled programs
    assert len(keys) == 300                                   # no number is given twice
    assert len(protocol._HELD) <= held + 1                    # the registry does not grow
    assert a == _holding(kept)

def _specs():
    """A conv → BatchNorm → dense net whose BatchNorm tensors are not named `.weight` / `.bias`."""
    return [ParamSpec("c.kernel", (4, 3, 3, 3), "conv", "weight", "norm"),
            ParamSpec("norm.scale", (4,), "ones", "gamma", "norm"),
            ParamSpec("norm.shift", (4,), "zeros", "beta", "norm"),
            ParamSpec("out.w", (10, 4), "dense"), ParamSpec("out.b", (10,), "zeros")]


def test_drawn_weights_read_the_role_never_the_name():
    specs = _specs()
    drawn = protocol.init_params(jax.random.key(0), specs, drawn=True)
    gamma, beta, bias = (np.asarray(drawn[k]) for k in ("norm.scale", "norm.shift", "out.b"))
    assert np.all(gamma != 1) and np.all((gamma >= DRAWN_GAMMA[0]) & (gamma <= DRAWN_GAMMA[1]))
    assert np.all(beta != 0) and np.all(bias != 0)
    # β drawn at its own scale (0.3), the bias at a bias's (0.1): the same normal draws, scaled
    again = protocol.init_params(jax.random.key(0), [s._replace(role="bias") if s.name == "norm.shift" else s
                                                     for s in specs], drawn=True)
    np.testing.assert_allclose(np.asarray(again["norm.shift"]) * 3, beta, rtol=1e-6)
    # named like a BatchNorm shift but declared a bias: drawn as a bias
    named = [ParamSpec("bn.weight", (4,), "ones"), ParamSpec("bn.bias", (4,), "zeros")]
    as_bias = protocol.init_params(jax.random.key(0), named, drawn=True)
    as_beta = protocol.init_params(jax.random.key(0), [named[0], named[1]._replace(role="beta")], drawn=True)
    np.testing.assert_allclose(np.asarray(as_bias["bn.bias"]) * 3, np.asarray(as_beta["bn.bias"]), rtol=1e-6)
    undrawn = protocol.init_params(jax.random.key(0), specs)
    assert np.all(np.asarray(undrawn["norm.scale"]) == 1) and np.all(np.asarray(undrawn["norm.shift"]) == 0)
    with pytest.raises(ValueError, match="norm.scale has role 'beta'"):
        protocol.init_params(jax.random.key(0), [specs[1]._replace(role="beta")])


def test_the_book_nets_declare_roles_and_batchnorms():
    roles, bn_of = resnet34.NET.roles(resnet34.NET.check_config()), resnet34.NET.bn_of(resnet34.NET.check_config())
    assert roles["layer2.0.downsample.1.bias"] == "beta" and roles["fc.bias"] == "bias"
    assert bn_of["layer2.0.downsample.0.weight"] == "layer2.0.downsample.1" and "fc.weight" not in bn_of
    assert cifar8.NET.roles()["conv1.bias"] == "bias" and cifar8.NET.bn_of()["conv1.bias"] == "bn1"


def test_a_module_is_not_a_net():
    with pytest.raises(TypeError, match=r"pass gradtie.nets.cifar8.NET, the Net it defines"):
        protocol.resolution_note(cifar8, 64)
    with pytest.raises(TypeError, match=r"tie.Point.of: expected a gradtie Net"):
        from gradtie.checks.tie import Point
        Point.of(resnet34, {}, jnp.zeros((1, 3, 32, 32)))
    assert not hasattr(cifar8, "init") and not hasattr(resnet34, "forward")   # the module aliases are gone


def test_generic_code_never_branches_on_a_net_name():
    """What a check or a run asks of a net is the Net's (its BatchNorm mode, which BatchNorm a node
    belongs to, its projections, its check classes, its α, its checkpoint's config): no comparison
    of a net's name, a suite's name or a config's `bn` attribute in the package. Left out: the two
    nets' own modules, their peers (each a re-implementation of the two nets in another framework)
    and the book's plots, which select the committed benchmark rows of each net."""
    import re
    from pathlib import Path

    import gradtie
    root = Path(gradtie.__file__).parent
    pattern = re.compile(r'(==|!=)\s*"(cifar8|resnet34)"|"(cifar8|resnet34)"\s*(==|!=)|in \("(cifar8|resnet34)"'
                         r'|\bnet\.suite\s*(==|!=)|\bself\.suite\s*(==|!=)|getattr\(cfg,\s*"bn"|\bas_net\(')
    skipped = ("nets/cifar8.py", "nets/resnet34.py", "peers/", "book/plots/")
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}"
             for path in sorted(root.rglob("*.py")) if not path.relative_to(root).as_posix().startswith(skipped)
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_projection_entry_plants_where_the_net_declares_it_whatever_the_names():
    """`projection_bn_reads_dn2` reads `Net.projections`: a projection BatchNorm named otherwise
    (here "skip.norm", its partner "main.norm3") is planted, and a net that declares no
    projection plants nothing even where a layer is called `*.downsample.1`."""
    from gradtie.kit import Call
    entry = bugs.CATALOGUE["projection_bn_reads_dn2"]
    net = dataclasses.replace(cifar8.NET, projections={"skip.norm": "main.norm3"})
    calls = [Call("bn_backward", (name,), {}, None) for name in ("main.norm3", "main.norm2", "skip.norm")]
    assert entry.uses(net, calls) and not entry.uses(cifar8.NET, calls)
    assert not entry.uses(net, calls[::-1])            # the partner's backward must come first
    renamed = [Call("bn_backward", (name,), {}, None) for name in ("layer2.0.bn2", "layer2.0.downsample.1")]
    assert not entry.uses(cifar8.NET, renamed)         # a name alone plants nothing
    assert entry.uses(resnet34.NET, renamed)

    def real(name, saved, weight, dy):                 # a BN backward that tags what it read
        return ("dx of", name, dy)
    backward = bugs._projection_reads_inner(net.projections, real)
    dn3 = backward("main.norm3", None, None, "da")
    assert backward("main.norm2", None, None, dn3) == ("dx of", "main.norm2", dn3)
    assert backward("skip.norm", None, None, "da") == ("dx of", "skip.norm", dn3)   # reads dn3, not da
    assert not bugs.CATALOGUE["projection_bn_reads_dn2"].applies(dataclasses.replace(resnet34.NET, projections={}),
                                                                 resnet34.NET.check_config())
    assert entry.applies(resnet34.NET, resnet34.NET.check_config())
