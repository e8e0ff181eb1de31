"""The fix inside the trainers people use, each in the form that trainer already offers.

- ``hf_trainer``  transformers' ``Trainer``: ``compute_loss_func=global_token_loss`` weighs every label
                  token by the step's global label count, whatever the model does with the loss kwargs
- ``trl_grpo``    TRL's ``GRPOTrainer``: ``GlobalTokenGRPOTrainer`` divides its counted losses (`dapo`) by the
                  optimizer step's token count, not the generation batch's rescaled
- ``accelerate_loop``  a plain accelerate loop: ``step_label_count`` (the one all-reduce) and
                  ``token_sum_loss`` (x W for DDP's mean, x A for ``accelerator.backward``'s 1/A)

Each names the versions it was tested with (``TESTED``) and is proven by the trainer audit
(``python -m gradnorm.audit --trainer``; tests/e2e/test_trainer_audit.py), with the same trainer
without it as the control that must fail.
"""
