#include "tests/raw_grpc_call.h"

#include <future>
#include <utility>

#include <grpcpp/generic/generic_stub.h>

namespace himoe::testutil {
namespace {

class Call final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit Call(const std::vector<std::string>& messages) : messages_(messages) {}

  // Deletes itself when the call is done.
  std::future<RawCallResult> Start(const std::shared_ptr<grpc::Channel>& channel,
                                   const std::string& method) {
    std::future<RawCallResult> result = done_.get_future();
    grpc::GenericStub stub(channel);
    stub.PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    StartRead(&in_);
    NextWrite();
    StartCall();
    return result;
  }

  void OnWriteDone(bool ok) override {
    if (ok) NextWrite();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (in_.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) bytes.append(s.begin(), s.end());
    }
    result_.replies.push_back(std::move(bytes));
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& status) override {
    result_.status = status;
    done_.set_value(std::move(result_));
    delete this;
  }

 private:
  void NextWrite() {
    if (next_ == messages_.size()) {
      StartWritesDone();
      return;
    }
    grpc::Slice slice(messages_[next_++]);
    out_ = grpc::ByteBuffer(&slice, 1);
    StartWrite(&out_);
  }

  const std::vector<std::string> messages_;
  size_t next_ = 0;
  grpc::ClientContext context_;
  grpc::ByteBuffer out_;
  grpc::ByteBuffer in_;
  RawCallResult result_;
  std::promise<RawCallResult> done_;
};

}  // namespace

RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::vector<std::string>& messages) {
  return (new Call(messages))->Start(channel, method).get();
}

}  // namespace himoe::testutil
