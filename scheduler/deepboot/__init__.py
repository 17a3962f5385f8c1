"""DeepBoot (Chen et al., TPDS'23): lend idle inference GPUs to elastic training, reclaim with least loss.

- :mod:`scheduler.deepboot.state` — inference replica states as the scheduler sees them;
- :mod:`scheduler.deepboot.costs` — restart / AFE resize costs and the restart penalty;
- :mod:`scheduler.deepboot.lending` — which inference GPUs are lendable, and placement over both pools;
- :mod:`scheduler.deepboot.ats_i` — ATS-I, placing inference tasks (reuse, free, sleep, reclaim);
- :mod:`scheduler.policies.deepboot` — ATS-T, the training policy ``deepboot``.
"""
