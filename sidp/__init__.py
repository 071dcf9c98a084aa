"""SiDP (../shared/papers/sidp.txt): data-parallel replicas that share FFN weights instead of
each holding all of them. Built: layer ownership with peak-shifted prefetch order, the shared FFN
store, per-rank weight slots with their prefetch / housekeeper thread (Weight as a Service,
§4.2), the engine build (strategies/sidp.py). Not yet: Compute as a Service and the mode switch."""
