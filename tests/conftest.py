import os


# Tests run on the CPU even where libtpu is installed (the `tpu` extra): libtpu is
# used only to compile for TPU v5e ahead of time, never as a runtime backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Compiles are slow on two cores: bound the number of examples, and never fail
# a property for being slow.
settings.register_profile(
    "ci",
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The tests that take longest (each 11 s or more on the 2-core machine, measured
# with `pytest --durations=60`): kept out of the README's test command so that it
# stays within a few minutes, and run by CI right after it (`pytest -m heavy`).
HEAVY = frozenset(
    {
        "tests/test_benchmarks.py::test_compile_time_quick",
        "tests/test_benchmarks.py::test_depth_scaling_quick",
        "tests/test_benchmarks.py::test_run_quick",
        "tests/test_benchmarks.py::test_seed_claim_run_mode_on_cpu",
        "tests/test_benchmarks.py::test_transformer_temp_memory_at_most_flax[None]",
        "tests/test_benchmarks.py::test_transformer_temp_memory_at_most_flax[dots]",
        "tests/test_benchmarks.py::test_transformer_temp_memory_at_most_flax[dots_no_batch]",
        "tests/test_benchmarks.py::test_transformer_temp_memory_at_most_flax[everything]",
        "tests/test_benchmarks.py::test_transformer_temp_memory_at_most_flax[nothing]",
        "tests/test_binomial.py::test_gradients_and_evaluations",
        "tests/test_binomial.py::test_memory_falls_and_evaluations_rise_as_slots_fall",
        "tests/test_binomial.py::test_vmap_conventions",
        "tests/test_docs.py::test_page_code_runs[api/eqx_remat/name_policies.md]",
        "tests/test_docs.py::test_page_code_runs[api/eqx_remat/schedules.md]",
        "tests/test_docs.py::test_page_code_runs[index.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/choosing-a-schedule.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/five-minutes.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/own-model.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/training.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/v5e-without-a-tpu.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/writing-a-schedule.md]",
        "tests/test_inspect.py::test_v5e_flash_attention_with_unsharded_arguments",
        "tests/test_plan.py::test_mixes_fit_cost_less_between_uniform_options_and_are_predicted",
        "tests/test_plan.py::test_the_pick_fits_and_costs_no_more_than_the_best_uniform_candidate",
        "tests/test_plan.py::test_v5e_prices_offloading_and_splits_by_the_batch_sharding",
        "tests/test_ranges.py::test_gradients_equal_the_unchecked_ones",
        "tests/test_schedules.py::test_count_flops_follows_the_evaluations_of_every_schedule[13]",
        "tests/test_schedules.py::test_count_flops_follows_the_evaluations_of_every_schedule[5]",
        "tests/test_schedules.py::test_forward_over_reverse_matches_unchecked[every(k=2, policy=None)]",  # noqa: E501
        "tests/test_schedules.py::test_parameter_dominated_stack_never_exceeds_none[plain]",
        "tests/test_schedules.py::test_scan_layers_gradients",
        "tests/test_sharding.py::test_explicit_mesh_one_device[gpt2]",
        "tests/test_sharding.py::test_explicit_mesh_one_device[llama]",
        "tests/test_sharding.py::test_padded_segments_keep_memory_space_and_sharding",
        "tests/test_sharding.py::test_sharded_gradients_equal_single_device_gradients",
        "tests/test_train.py::test_fsdp_checkpoint_restores_into_its_shardings",
        "tests/test_train.py::test_loss_decreases",
        "tests/test_train.py::test_resume_with_other_run_options_fails",
        "tests/test_train.py::test_sigterm_then_resume_is_bit_identical",
        "tests/test_train.py::test_stop_after_then_extend_is_bit_identical",
        "tests/test_train.py::test_switching_the_checkpoint_keeps_the_loss_curve",
        "tests/test_transformer.py::test_attention_implementations_agree",
        "tests/test_transformer.py::test_gqa_equals_repeated_heads",
        "tests/test_transformer.py::test_gradients[dots]",
        "tests/test_transformer.py::test_gradients_options_property",
        "tests/test_transformer.py::test_gradients_property",
        "tests/test_transformer.py::test_llama",
        "tests/test_transformer.py::test_memory[dots-0.6]",
        "tests/test_transformer.py::test_option_gradients[nothing-dot_product]",
        "tests/test_transformer.py::test_option_gradients[nothing-flash]",
        "tests/test_transformer.py::test_option_gradients[nothing-mqa]",
        "tests/test_zoo.py::test_gradients_property",
        "tests/test_zoo.py::test_mlp_gradients[offload_dots_no_batch]",
        "tests/test_zoo.py::test_save_all_but_names_compiled_memory[Transformer-qkv_proj]",
        "tests/test_zoo.py::test_unroll_keeps_gradients[None-Transformer]",
        "tests/test_zoo.py::test_unroll_keeps_gradients[dots-MLP]",
        "tests/test_zoo.py::test_unroll_keeps_gradients[dots-Transformer]",
        "tests/test_zoo.py::test_unroll_keeps_gradients[recursive(policy=None)-Transformer]",
        # Issue 32: the quick suite within 600 CPU-seconds (4.4 s or more each).
        "tests/test_plan.py::test_a_schedule_compiles_to_no_less_than_its_floor[binomial(slots=2, policy=None)]",  # noqa: E501
        "tests/test_plan.py::test_a_schedule_compiles_to_no_less_than_its_floor[recursive(policy=None)]",  # noqa: E501
        "tests/test_schedules.py::test_forward_over_reverse_matches_unchecked[nested(levels=2, policy=None)]",  # noqa: E501
        "tests/test_schedules.py::test_vmap_conventions[recursive(policy=None)]",
        "tests/test_transformer.py::test_dropout_gradients[nothing]",
        "tests/test_transformer.py::test_option_gradients[nothing-rms]",
        "tests/test_transformer.py::test_option_gradients[nothing-rope]",
        "tests/test_zoo.py::test_unroll_keeps_gradients[None-MLP]",
        "tests/test_benchmarks.py::test_each_variant_in_its_own_process",
        "tests/test_benchmarks.py::test_plan_sweep_quick",
        "tests/test_benchmarks.py::test_variant_that_does_not_fit_is_a_row",
        "tests/test_combinators.py::test_list_memory_is_stacking_by_hand_no_switch[None]",  # noqa: E501
        "tests/test_combinators.py::test_list_memory_is_stacking_by_hand_no_switch[every(k=2, policy=None)]",  # noqa: E501
        "tests/test_docs.py::test_page_code_runs[README.md]",
        "tests/test_docs.py::test_page_code_runs[api/zoo/transformer.md]",
        "tests/test_docs.py::test_page_code_runs[tutorials/fit-a-budget.md]",
        "tests/test_plan.py::test_a_mispriced_pick_loses_to_a_compiled_uniform_option",
        "tests/test_plan.py::test_a_schedule_compiles_to_no_less_than_its_floor[every(k=2, policy='dots')]",  # noqa: E501
        "tests/test_plan.py::test_a_schedule_compiles_to_no_less_than_its_floor[every(k=2, policy=None)]",  # noqa: E501
        "tests/test_plan.py::test_a_schedule_compiles_to_no_less_than_its_floor[nested(levels=2, policy=None)]",  # noqa: E501
        "tests/test_plan.py::test_after_mixes_that_do_not_fit_the_planner_chooses_among_uniform_options",  # noqa: E501
        "tests/test_plan.py::test_an_option_refused_on_every_layer_is_predicted_from_compiled_mixes",  # noqa: E501
        "tests/test_plan.py::test_solver_on_priced_options_matches_an_exhaustive_search",  # noqa: E501
        "tests/test_plan.py::test_the_cheapest_option_that_fits_needs_no_more_than_the_two_ends",  # noqa: E501
        "tests/test_ranges.py::test_a_range_of_one_layer_keeps_what_longer_ranges_keep[None]",  # noqa: E501
        "tests/test_ranges.py::test_a_range_of_one_layer_keeps_what_longer_ranges_keep[dots]",  # noqa: E501
        "tests/test_ranges.py::test_a_range_of_one_layer_keeps_what_longer_ranges_keep[nothing]",  # noqa: E501
        "tests/test_ranges.py::test_parameter_dominated_stack_stays_within_none_plus_one_layer[plain]",  # noqa: E501
        "tests/test_ranges.py::test_parameter_dominated_stack_stays_within_none_plus_one_layer[vmap]",  # noqa: E501
        "tests/test_ranges.py::test_scan_layers_chain_and_set_checkpoint_take_ranges[D7]",  # noqa: E501
        "tests/test_schedules.py::test_count_flops_follows_the_evaluations_of_every_schedule[16]",  # noqa: E501
        "tests/test_schedules.py::test_forward_over_reverse_matches_unchecked[every(k=3, policy='dots')]",  # noqa: E501
        "tests/test_schedules.py::test_forward_over_reverse_matches_unchecked[recursive(policy=None)]",  # noqa: E501
        "tests/test_schedules.py::test_grad_of_grad[recursive(policy=None)]",
        "tests/test_schedules.py::test_parameter_dominated_stack_never_exceeds_none[vmap]",  # noqa: E501
        "tests/test_schedules.py::test_vmap_conventions[every(k=3, policy=None)]",
        "tests/test_transformer.py::test_bf16_gradients[nothing]",
        "tests/test_transformer.py::test_memory[nothing-0.3]",
        "tests/test_transformer.py::test_option_gradients[every(k=2, policy=None)-dot_product]",  # noqa: E501
        "tests/test_transformer.py::test_option_gradients[every(k=2, policy=None)-flash]",  # noqa: E501
        "tests/test_transformer.py::test_option_gradients[every(k=2, policy=None)-mqa]",
        "tests/test_zoo.py::test_integer_arguments_take_any_integer_type[Transformer-vocab_size-np.int64]",  # noqa: E501
        "tests/test_zoo.py::test_save_all_but_names_compiled_memory[Transformer-out_proj]",  # noqa: E501
        # Issue 29: micro-batches and the chunked loss head.
        "tests/test_accumulate.py::test_sharded_data_parallel_and_fsdp_stay_local",
        "tests/test_accumulate.py::test_equals_the_full_batch",
        "tests/test_docs.py::test_page_code_runs[tutorials/fit-a-batch.md]",
        "tests/test_loss.py::test_cross_entropy_equals_the_whole_logits",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in HEAVY:
            item.add_marker(pytest.mark.heavy)
