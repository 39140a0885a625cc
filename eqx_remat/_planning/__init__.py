"""Planning: pick the checkpoint that fits a memory budget at the least cost.
The entries (`_api`: `plan`); the one pricer (`_prices`, over
`eqx_remat._roofline`'s tracing),
cost model (`_cost`, over the solver's pieces in `_solve`), loop and race
(`_loop`); what was learnt (`_evidence`) and the one part with effects
(`_bench`; the cache, `_cache`; it compiles with `eqx_remat._inspect._compiled`
and times on `eqx_remat._inspect._clock`, the clock the benchmarks use too);
the thresholds (`_thresholds`); the report (`_report`); the outer loop over
ways of running a batch (`_batch`); and the tests' one way in (`testing`)."""
