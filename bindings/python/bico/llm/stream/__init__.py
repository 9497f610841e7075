"""bico.llm.stream: the models run a block at a time from their folders
(memory that does not grow with their depth), for the fit
(python3 -m bico.llm --method fit, bico.llm.transfer_model on folders) and
the distillation's teacher.

  stats.py    the first two sweeps over the calibration windows: boundary
              states and the norms' statistics going up, gradients coming
              down (Run, forward_sweep, backward_sweep)
  fit.py      the fit's sweep: bico.fit.run over the target's blocks
              (fit_blocks)
  out.py      a fit's result in the spill store, its held-out scoring,
              the folder and adapter writers
  route.py    StreamedFit (the three sweeps as the routes call them), the
              command's and transfer_model's streamed fit
  teacher.py  the proxy-tuned teacher from the folders a block at a time

bico.llm.runtime holds the pieces they share (a folder read a block at a
time, the spill store, a layer's forward by stage).
"""
