/* Writes a step's new K and V rows into the paged cache, float32: token i's rows go to block
 * slots[i] / block_size, offset slots[i] % block_size; a negative slot is skipped.
 *
 * torch's index_put_ did this at ~38 us a call on the 2-core VM, nearly all of it fixed
 * overhead (a decode step writes a few KiB per layer); this is a memcpy per row.
 *
 * Layouts (element strides):
 *   key, value    [num_tokens, row] (row = num_kv_heads * head_size contiguous floats),
 *                 rows key_s0 / value_s0 apart (views of the fused qkv output)
 *   k/v cache     [num_blocks, block_size, row], each block contiguous, blocks cache_bs apart
 *   slots         [num_tokens] int64, each < num_blocks * block_size (checked by the caller)
 */
#include <stdint.h>
#include <string.h>

/* Steps writing fewer bytes than this stay on one thread: waking the other costs more. */
#define PARALLEL_MIN_BYTES (256 * 1024)

void write_kv_f32(const float *key, int64_t key_s0, const float *value, int64_t value_s0,
                  float *k_cache, float *v_cache, int64_t cache_bs, const int64_t *slots,
                  int64_t num_tokens, int64_t row, int64_t block_size, int num_threads) {
    const size_t bytes = (size_t)row * sizeof(float);
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if ((int64_t)bytes * 2 * num_tokens >= PARALLEL_MIN_BYTES)
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        const int64_t at = slot / block_size * cache_bs + slot % block_size * row;
        memcpy(k_cache + at, key + i * key_s0, bytes);
        memcpy(v_cache + at, value + i * value_s0, bytes);
    }
}
