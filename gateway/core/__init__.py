"""The functional core: the scheduling loop, requests, the pool view and state, batching, budgets, scoring
terms, progressive planning and the engine model. No I/O and no wall clock (time is passed in): the live
server (gateway/serving/driver.py) and the simulator (gateway/lab/sim/) drive the same loop."""
