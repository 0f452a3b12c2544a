// Autograd behaviour of the mutating ops (those whose schema marks an argument `Tensor(x!)` and returns
// `()`), so that they act like built-in in-place ops:
//  - Autograd: an inference tensor may be written only inside inference mode, and a tensor that
//    requires grad is refused while grad mode is on (these ops have no derivative);
//  - ADInplaceOrView: every written tensor's version counter is bumped, so a backward that saved the
//    old values raises "modified by an inplace operation" instead of silently using the new ones.
// torch's own autogradNotImplemented*Fallback kernels bump only tensors that an op returns, and our
// mutating ops return nothing, hence these boxed kernels. Both are no-ops (never reached) inside
// torch.inference_mode(), where the rollout calls the ops.
#include <ATen/core/LegacyTypeDispatch.h>  // AutoDispatchBelow*: not pulled in by the others on torch 2.11
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

namespace torchkvops {
namespace {

// Calls fn(argument name, tensor) for every tensor argument the schema marks as written.
template <typename Fn>
void for_each_written_tensor(const c10::OperatorHandle& op, const torch::jit::Stack* stack, Fn fn) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    const c10::IValue& value = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && value.isTensor()) fn(args[i].name(), value.toTensor());
  }
}

// "torchkvops::repeat_kv_cache_" -> "repeat_kv_cache_", as the kernels' own messages start.
std::string short_name(const c10::OperatorHandle& op) {
  const std::string& qualified = op.schema().name();
  return qualified.substr(qualified.find("::") + 2);
}

void check_not_inference(const std::string& name, const std::string& arg, const at::Tensor& t) {
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), name, ": ", arg,
              " is an inference tensor (made under torch.inference_mode()); writing it in place outside "
              "inference mode is not allowed, as for torch's own in-place ops. Call this inside "
              "torch.inference_mode() or pass a clone.");
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const std::string name = short_name(op);
  for_each_written_tensor(op, stack, [&](const std::string& arg, const at::Tensor& t) {
    check_not_inference(name, arg, t);
    TORCH_CHECK(!(t.requires_grad() && c10::GradMode::is_enabled()), name, ": ", arg,
                " requires grad, but this in-place op has no derivative; call it under torch.no_grad() "
                "(or on a tensor that does not require grad)",
                t.is_leaf() ? "" : ", or use the functional form where there is one");
  });
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

void inplace_or_view_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  // Inference tensors skip the Autograd key but not this one: check before anything is written.
  const std::string name = short_name(op);
  std::vector<at::Tensor> written;
  for_each_written_tensor(op, stack, [&](const std::string& arg, const at::Tensor& t) {
    check_not_inference(name, arg, t);
    written.push_back(t);
  });
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

// Every mutating op, named once for both blocks below. A mutating op missing here would lose its
// version-counter bumps without any error; tests/test_schemas.py checks this list against the schemas.
constexpr const char* kMutatingOps[] = {
    "repeat_kv_cache_",
    "write_kv_",
    "write_kv_slots_",
};

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, Autograd, m) {
  for (const char* name : kMutatingOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  }
}

TORCH_LIBRARY_IMPL(torchkvops, ADInplaceOrView, m) {
  for (const char* name : kMutatingOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inplace_or_view_kernel>());
  }
}

}  // namespace torchkvops
