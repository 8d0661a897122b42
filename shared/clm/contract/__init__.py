"""The decision contract: what every dialect, the trainer and the server agree on, defined once (no HTTP, no torch).

* :mod:`clm.contract.names` — the model names every service and client answers to (``clm-latest``, ``clm-raw``).
* :mod:`clm.contract.question_types` — the three question types, their loss type ids and the noul vocabulary.
* :mod:`clm.contract.answers` — probabilities from logits (softmax, tempering, the raw scale), each dialect's
  confidence and each dialect's answer object.
* the texts the encoder reads are :mod:`clm.texts` and the question models :mod:`clm.records.questions`
  (both already one module each, imported by everything that reads or writes a question).

``tests/unit/test_one_definition.py`` fails when a model name or an answer builder is defined anywhere else.
"""
