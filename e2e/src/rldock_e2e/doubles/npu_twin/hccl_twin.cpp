// The npu twin's stand-in for HCCL: a c10d Backend for npu tensors that stages every collective
// through host memory and runs it on a gloo backend (a test double; see collectives.py).
//
// It is a C++ Backend, not a Python ProcessGroup, because c10d then keeps it as the `npu` backend
// of an ordinary device-keyed group beside gloo for host tensors, exactly as "cpu:gloo,npu:hccl"
// is with torch_npu, and every caller reaches it: torch.distributed's Python API and the C++
// dispatch of functional collectives (DTensor's full_tensor, FSDP2's device mesh) alike.
// Collectives run synchronously; the returned Work is already complete. Sends and receives are asynchronous.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace npu_twin {
namespace {

class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result)
      : future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(std::move(result)));
    finish();
  }
  // DDP's reducer and comm hooks read the result through the future.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

at::Tensor to_host(const at::Tensor& tensor) { return tensor.detach().to(at::kCPU).contiguous(); }

std::vector<at::Tensor> to_host(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> hosts;
  hosts.reserve(tensors.size());
  for (const auto& tensor : tensors) hosts.push_back(to_host(tensor));
  return hosts;
}

void copy_back(std::vector<at::Tensor>& devices, const std::vector<at::Tensor>& hosts) {
  for (size_t i = 0; i < devices.size(); ++i) devices[i].copy_(hosts[i]);
}

c10::intrusive_ptr<c10d::Work> done(std::vector<at::Tensor> result) {
  return c10::make_intrusive<DoneWork>(std::move(result));
}

// A receive in flight: gloo's receive into host memory, copied onto the device when waited for. Point-to-point
// operations stay asynchronous (unlike the collectives here), since a pipeline posts a send and a receive
// together and waits for both: a send that blocked until its peer received could wait in a circle.
class StagedReceiveWork : public c10d::Work {
 public:
  StagedReceiveWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> devices,
                    std::vector<at::Tensor> hosts)
      : inner_(std::move(inner)), devices_(std::move(devices)), hosts_(std::move(hosts)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    copy_back(devices_, hosts_);
    finish();
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> devices_;
  std::vector<at::Tensor> hosts_;
};

class HostStagedBackend : public c10d::Backend {
 public:
  explicit HostStagedBackend(c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override { return "hccl_twin"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto hosts = to_host(tensors);
    gloo_->broadcast(hosts, opts)->wait();
    copy_back(tensors, hosts);
    return done(tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto hosts = to_host(tensors);
    gloo_->allreduce(hosts, opts)->wait();
    copy_back(tensors, hosts);
    return done(tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    std::vector<std::vector<at::Tensor>> host_outputs;
    for (const auto& list : outputs) host_outputs.push_back(to_host(list));
    auto host_inputs = to_host(inputs);
    gloo_->allgather(host_outputs, host_inputs, opts)->wait();
    std::vector<at::Tensor> result;
    for (size_t i = 0; i < outputs.size(); ++i) {
      copy_back(outputs[i], host_outputs[i]);
      result.insert(result.end(), outputs[i].begin(), outputs[i].end());
    }
    return done(result);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    gloo_->_allgather_base(host_output, host_input, opts)->wait();
    output.copy_(host_output);
    return done({output});
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    for (size_t i = 0; i < outputs.size(); ++i) _allgather_base(outputs[i], inputs[i], opts);
    return done(outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    gloo_->_reduce_scatter_base(host_output, host_input, opts)->wait();
    output.copy_(host_output);
    return done({output});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    for (size_t i = 0; i < outputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
    return done(outputs);
  }

  // Expert parallelism's dispatch and combine (uneven splits).
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override {
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    gloo_->alltoall_base(host_output, host_input, outputSplitSizes, inputSplitSizes, opts)->wait();
    output.copy_(host_output);
    return done({output});
  }

  // Tensor parallelism's plan: DTensor's distribute_tensor cuts each weight on the first rank and scatters it.
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto host_outputs = to_host(outputs);
    std::vector<std::vector<at::Tensor>> host_inputs;
    for (const auto& list : inputs) host_inputs.push_back(to_host(list));
    gloo_->scatter(host_outputs, host_inputs, opts)->wait();
    copy_back(outputs, host_outputs);
    return done(outputs);
  }

  // Pipeline parallelism's activations and their gradients (asynchronous: StagedReceiveWork says why).
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override {
    auto hosts = to_host(tensors);  // gloo's send keeps its tensors until it is done
    return gloo_->send(hosts, dstRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override {
    auto hosts = to_host(tensors);
    auto inner = gloo_->recv(hosts, srcRank, tag);
    return c10::make_intrusive<StagedReceiveWork>(std::move(inner), tensors, std::move(hosts));
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo_->barrier(opts);
  }

 private:
  c10::intrusive_ptr<c10d::Backend> gloo_;
};

}  // namespace

void bind_hccl_twin(pybind11::module& m) {
  m.def("host_staged_backend",
        [](c10::intrusive_ptr<c10d::Backend> gloo) -> c10::intrusive_ptr<c10d::Backend> {
          return c10::make_intrusive<HostStagedBackend>(std::move(gloo));
        },
        "the hccl_twin backend: npu collectives staged through host memory onto `gloo`");
}

}  // namespace npu_twin
