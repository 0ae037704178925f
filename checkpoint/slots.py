"""Optimizer slots at a restore: which of a checkpoint's slots the model's
optimizers use, and the initial values they declare (docs/ARCHITECTURE.md,
"Checkpoints"). The checkpoint holds each slot's values and, since it was
saved with them, its initial value; what the model's optimizers say decides
the rest."""
__all__ = ["slots_to_load", "slot_initial_values"]


def slots_to_load(chain, optimizers, drop_unused, where):
    """None (every slot) or the set of slot names the model's `optimizers` use.

    Only when every optimizer is an evstore one (it lists `ev_slot_names`);
    without an optimizer, or with another, every slot is loaded.

    Raises:
      ValueError: a checkpoint of `chain` holds slots none of them uses (an
        Adam checkpoint restored into an SGD model), unless `drop_unused`;
        `where` names the root in the message.
    """
    opts = [o for o in optimizers if hasattr(o, "ev_slot_names")]
    if not opts or len(opts) != len(optimizers):
        return None
    used = {s for o in opts for s in o.ev_slot_names}
    extra = {}
    for m in chain:
        for name, e in m.evs.items():
            unused = sorted(set(e["slots"]) - used)
            if unused:
                extra.setdefault(name, unused)
    if extra and not drop_unused:
        kinds = ", ".join(sorted({type(o).__name__ for o in opts}))
        raise ValueError(f"checkpoint {chain[-1].dir} of {where} holds optimizer slots {extra} that the "
                         f"model's optimizer ({kinds}) does not use: it was trained with another optimizer. "
                         "Restore into a model with that optimizer, or pass drop_unused_slots=True to load "
                         "rows without those slots")
    return used


def slot_initial_values(optimizers, ev):
    """{slot name: initial value} the model's `optimizers` declare for `ev`'s
    slots: a fused optimizer's for every EV, a built generic-path (any Keras)
    optimizer's for the EVs it trains. A restore uses them for the slots a
    checkpoint written before initial values were saved lacks them for."""
    out = {}
    for o in optimizers:
        if hasattr(o, "ev_slot_initial_values"):
            out.update(o.ev_slot_initial_values())
        else:   # a Keras optimizer: Keras and evstore.generic are imported
            from evstore import generic
            out.update(generic.slot_initial_values(o).get(id(ev), {}))
    return out
