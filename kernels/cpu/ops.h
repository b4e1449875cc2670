// The ops of the compiled CPU module (bound in module.cpp; shapes in each definition's comment).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

void grid_bounds(torch::Tensor q, torch::Tensor page_ids, torch::Tensor page_req, torch::Tensor lo,
                 torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, int64_t bits, int64_t page_size,
                 torch::Tensor tok, torch::Tensor pb);
void certified_hist(torch::Tensor tok, torch::Tensor pb, torch::Tensor page_req, torch::Tensor ref, double sigma,
                    torch::Tensor hist);
void certified_dropped(torch::Tensor tok, torch::Tensor pb, torch::Tensor page_req, torch::Tensor ref,
                       torch::Tensor t, double sigma, torch::Tensor out);
void grid_sparse_attend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo,
                        torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, torch::Tensor page_ids,
                        torch::Tensor chunk_req, torch::Tensor chunk_begin, torch::Tensor chunk_end, torch::Tensor t,
                        torch::Tensor t_gate, torch::Tensor ref, double sigma, int64_t bits, int64_t page_size,
                        torch::Tensor m_out, torch::Tensor l_out, torch::Tensor o_out, torch::Tensor counts,
                        torch::Tensor mass);
void exact_part(torch::Tensor q, torch::Tensor k_cache, torch::Tensor dense_slots, torch::Tensor dense_req,
                torch::Tensor sample_slots, torch::Tensor sample_req, double sigma, double budget,
                torch::Tensor s_dense, torch::Tensor sample, torch::Tensor ref, torch::Tensor z, torch::Tensor t);
void merge_chunks(torch::Tensor s_dense, torch::Tensor dense_slots, torch::Tensor dense_req, torch::Tensor v_cache,
                  torch::Tensor m, torch::Tensor l, torch::Tensor o, torch::Tensor chunk_req, double sigma,
                  torch::Tensor out);
void chunk_totals(torch::Tensor counts, torch::Tensor mass, torch::Tensor chunk_req, torch::Tensor per_head,
                  torch::Tensor per_req, torch::Tensor masses);
void fused_step(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo, torch::Tensor scale,
                torch::Tensor radius, torch::Tensor codes, torch::Tensor dense_slots, torch::Tensor dense_req,
                torch::Tensor sample_slots, torch::Tensor sample_req, torch::Tensor page_ids, torch::Tensor chunk_req,
                torch::Tensor chunk_begin, torch::Tensor chunk_end, double sigma, double budget, double t_fixed,
                bool value_gate, int64_t bits, int64_t page_size, torch::Tensor s_dense, torch::Tensor sample,
                torch::Tensor ref, torch::Tensor z, torch::Tensor t, torch::Tensor gate, torch::Tensor m_out,
                torch::Tensor l_out, torch::Tensor o_out, torch::Tensor counts, torch::Tensor mass,
                torch::Tensor result, torch::Tensor per_head, torch::Tensor per_req, torch::Tensor masses);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, bool> step_stats(
    torch::Tensor t, torch::Tensor z, torch::Tensor per_head, torch::Tensor per_req, torch::Tensor masses,
    torch::Tensor index_dropped, torch::Tensor num_indexed, double fallback_fraction, int64_t h_kv);
std::tuple<double, double> exp_ps16_error(double lo, double hi);
using FusedDecodeResult = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                     torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, bool>;
FusedDecodeResult fused_decode(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo, torch::Tensor scale,
    torch::Tensor radius, torch::Tensor codes, torch::Tensor dense_slots, torch::Tensor dense_req,
    torch::Tensor sample_slots, torch::Tensor sample_req, torch::Tensor page_ids, torch::Tensor chunk_req,
    torch::Tensor chunk_begin, torch::Tensor chunk_end, double sigma, double budget, double t_fixed, bool value_gate,
    int64_t bits, int64_t page_size, torch::Tensor s_dense, torch::Tensor sample, torch::Tensor ref, torch::Tensor z,
    torch::Tensor t, torch::Tensor gate, torch::Tensor m_out, torch::Tensor l_out, torch::Tensor o_out,
    torch::Tensor counts, torch::Tensor mass, torch::Tensor result, torch::Tensor per_head, torch::Tensor per_req,
    torch::Tensor masses, torch::Tensor num_indexed, double fallback_fraction, std::optional<torch::Tensor> out);
