// Host implementation of the split-KV tile scheduler (spec §4.2-§4.3).
#include "core/scheduler.h"

#include <algorithm>

namespace flashmla::core {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

int64_t dense_decode_num_sm_parts(int num_sms, int64_t s_q, int64_t h_q, int64_t h_kv) {
  const int64_t rows = s_q * (h_q / h_kv);
  return std::max<int64_t>(num_sms / h_kv / ceil_div(rows, 64), 1);
}

int64_t sparse_decode_num_sm_parts(int num_sms, int64_t s_q, int64_t h_q) {
  return std::max<int64_t>(num_sms / s_q / std::max<int64_t>(h_q / 64, 1), 1);
}

void compute_tile_schedule(const std::vector<int64_t>& seqlens, int64_t num_sm_parts,
                           TileSchedulerMetadataRow* metadata, int32_t* num_splits) {
  const int64_t b = static_cast<int64_t>(seqlens.size());
  const int64_t overhead = kSchedFixedOverheadBlocks;
  std::vector<int64_t> num_blocks(b), last_block(b);
  int64_t total = 0;
  for (int64_t i = 0; i < b; ++i) {
    last_block[i] = std::max<int64_t>(seqlens[i] - 1, 0) / kSchedBlockSizeN;
    num_blocks[i] = last_block[i] + 1;  // an empty request still costs one block
    total += num_blocks[i] + overhead;
  }
  const int64_t payload = ceil_div(total, num_sm_parts) + overhead;

  int64_t req = 0, block = 0, split = 0, cum = 0;
  num_splits[0] = 0;
  for (int64_t part = 0; part < num_sm_parts; ++part) {
    TileSchedulerMetadataRow row{};
    row.begin_req_idx = static_cast<int32_t>(req);
    row.begin_block_idx = static_cast<int32_t>(block);
    row.begin_split_idx = static_cast<int32_t>(split);
    row.is_first_req_splitted = block != 0;
    int64_t remain = payload;
    while (req < b) {
      const int64_t left = num_blocks[req] - block;
      if (remain >= left + overhead) {  // the request finishes in this part
        cum += split + 1;
        num_splits[req + 1] = static_cast<int32_t>(cum);
        remain -= left + overhead;
        ++req;
        block = 0;
        split = 0;
      } else {
        if (remain - overhead > 0) {
          block += remain - overhead;
          split += 1;
        }
        break;
      }
    }
    int64_t end_req = block > 0 ? req : req - 1;
    int64_t end_block;
    if (block > 0) {
      end_block = block;
    } else {
      end_block = (req >= 1 && seqlens[req - 1] == 0) ? 0 : (req >= 1 ? last_block[req - 1] + 1 : 0);
    }
    bool last_splitted = false;
    if (end_req >= 0 && end_req < b) {
      last_splitted = end_block != last_block[end_req] + 1 && seqlens[end_req] != 0;
    }
    row.end_req_idx = static_cast<int32_t>(end_req);
    row.end_block_idx = static_cast<int32_t>(end_block);
    row.is_last_req_splitted = last_splitted;
    if (row.begin_req_idx == row.end_req_idx) {
      const int32_t either = row.is_first_req_splitted || row.is_last_req_splitted;
      row.is_first_req_splitted = either;
      row.is_last_req_splitted = either;
    }
    row.pad = 0;
    metadata[part] = row;
  }
}

}  // namespace flashmla::core
